"""A vLLM worker extension for RL (``LLM(..., worker_extension_cls="hal.vllm.worker.HalWorkerExtension")``).

Its methods run in every worker through ``llm.collective_rpc("<name>")`` (names, not callables, so
multi-process engines need no insecure serialization):

* ``hal_binding``: what this worker's model actually bound, found by walking its modules, not by
  trusting the config: the backend and fingerprint every routed op holds, any op left unrouted, and
  (a probe forward, ``hal.vllm.introspection.probe_hal_calls``) any routed module that made no HAL call;
* ``hal_weight_pointers`` / ``hal_weights_digest``: storage addresses, and a digest per parameter
  (``hal.digest.tensor_digest``, read on the worker's device; vLLM names, which the trainer's
  ``DecoderLM`` shares), so a weight sync can be checked to be in place and complete.
"""

from __future__ import annotations

import os

import torch

from hal.digest import tensor_digests


def pack_weights(weights) -> list[tuple[str, str, list[int], bytes]]:
    """(name, tensor) pairs as plain values, for an engine core in another process: collective_rpc's
    serialisation carries bytes, strings and lists exactly, but not a tensor in an untyped argument."""
    packed = []
    for name, t in weights:
        t = t.detach().to("cpu").contiguous()
        packed.append((name, str(t.dtype).replace("torch.", ""), list(t.shape),
                       t.view(torch.uint8).numpy().tobytes() if t.numel() else b""))
    return packed


def unpack_weights(packed) -> list[tuple[str, torch.Tensor]]:
    """``pack_weights``'s pairs back as tensors (the same bytes)."""
    out = []
    for name, dtype, shape, data in packed:
        dtype = getattr(torch, dtype)
        t = (torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data
             else torch.empty(0, dtype=dtype))
        out.append((name, t.reshape(shape)))
    return out


def trainer_name(vllm_name: str) -> str:
    """The trainer's (``hal.model``) name of a vLLM parameter: the same, except that vLLM's FusedMoE layer
    keeps its expert weights one module deeper (``mlp.experts.routed_experts.w13_weight``)."""
    return vllm_name.replace(".experts.routed_experts.", ".experts.")


class HalWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def _hal_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def hal_binding(self) -> dict:
        """{"bindings": [the distinct EngineBinding dicts the routed ops hold], "unrouted": [modules of a
        routed kind (linear, lm_head, norm, activation, RoPE, attention) that hold no HAL route],
        "silent": [routed modules that made no HAL call in a probe forward (HAL-bound engines only)],
        "routed": {kind: how many modules of it hold a HAL route}, "pid": this worker's process id}."""
        from hal.vllm.introspection import probe_hal_calls, routed_binding, silent_modules
        from hal.vllm.quant import HalConfig

        bindings, unrouted, routed = set(), [], {}
        for name, module in self._hal_model().named_modules():
            kind, binding = routed_binding(module)
            if binding is not None:
                bindings.add(binding)
                routed[kind] = routed.get(kind, 0) + 1
            elif kind is not None:
                unrouted.append(f"{name} ({kind})")
        silent = []
        if isinstance(self.model_runner.vllm_config.quant_config, HalConfig):
            silent = silent_modules(probe_hal_calls(self.model_runner))
        return {"bindings": [b.to_dict() for b in sorted(bindings, key=str)], "unrouted": unrouted,
                "silent": silent, "routed": routed, "pid": os.getpid()}

    def hal_load_weights(self, weights: list[tuple[str, torch.Tensor]] | None = None, packed=None) -> int:
        """Copy (HF name, tensor) pairs into the model's parameters through the model's own ``load_weights``
        (its per-parameter loaders write into the existing storage), skipping vLLM's layerwise
        ``reload_weights`` machinery (which moves every layer's tensors to the meta device and back, then
        re-runs the weight processing): a HAL-bound engine keeps its weights exactly as loaded, so there
        is nothing to re-process. ``packed``: the pairs as ``pack_weights`` made them (an engine core in
        another process). Returns how many parameters were written."""
        if packed is not None:
            weights = unpack_weights(packed)
        with torch.no_grad():
            loaded = self._hal_model().load_weights(weights)
        return len(loaded or ())

    def hal_reload_weights(self, packed) -> None:
        """vLLM's own ``reload_weights`` (stock engines) on ``pack_weights``'s pairs."""
        self.reload_weights(weights_iterator=unpack_weights(packed))

    def hal_spec_decode_stats(self) -> dict:
        """{"draft_tokens", "accepted_tokens"} verified so far by the HAL's draft verification (empty when the
        engine does not speculate)."""
        sampler = getattr(self.model_runner, "rejection_sampler", None)
        return dict(getattr(sampler, "hal_stats", {}))

    def hal_weight_pointers(self) -> dict:
        """{parameter name (the trainer's, ``trainer_name``): data_ptr}: where each weight lives (a sync
        must not move it)."""
        return {trainer_name(name): p.data_ptr() for name, p in self._hal_model().named_parameters()}

    def hal_weights_digest(self, rows: dict[str, int] | None = None) -> dict:
        """{parameter name (the trainer's): [digest, data_ptr, shape]} of the engine's weights; ``rows`` limits a
        parameter to its first rows (vLLM pads the vocabulary of the embedding and lm_head to a multiple
        of 64). Stock CPU linears report an empty weight: vLLM repacked it for oneDNN."""
        rows = rows or {}
        names, params, views = [], [], []
        for name, p in self._hal_model().named_parameters():
            name = trainer_name(name)
            names.append(name)
            params.append(p)
            views.append(p[:rows.get(name, p.shape[0])] if p.dim() else p)
        return {name: [digest, p.data_ptr(), list(view.shape)]
                for name, p, view, digest in zip(names, params, views, tensor_digests(views))}

