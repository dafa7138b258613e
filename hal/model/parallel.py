"""The decoder LLM sharded Megatron-style over a tensor-parallel group, with the bits of one device.

    tp = TensorParallel.current()                                  # after dist.init_process_group
    shard = ParallelDecoderLM.from_full(model, tp)                 # this rank's shard of a DecoderLM
    completions = RolloutHarness(shard, cfg).generate(requests)    # every rank runs the same calls
    with torch.no_grad():
        train = recompute_logprobs(shard, completions)

Layout (rank r of n, vLLM's and Megatron's):
  qkv_proj, gate_up_proj   column-parallel: the rank's query heads, KV heads, gate and up rows;
  attention, q/k norm      head-parallel: the rank's heads, local (GQA groups stay whole);
  o_proj, down_proj        row-parallel: the rank's K columns, combined by ``hal.parallel.row_parallel_linear``
                           (all-gathered fp32 K-chunk partials, ascending chunk order);
  embed_tokens, lm_head    vocab-parallel: the rank's vocab rows; the embedding is a copy from the owner,
                           logprobs go through ``hal.parallel.vocab_parallel_token_logprobs``;
  norms                    replicated (every rank computes the same bits).
So the shard's logits and logprobs are bitwise those of the unsharded model on one device, at every
degree that cuts K and the vocabulary into whole contract chunks ([parallel]).

A shard holds a ``DecoderLM`` of its own sizes (``config``: heads, KV heads, intermediate and vocab
divided by n) and runs the model's own ``_core``; only the embedding, the two row-parallel linears and
the logprobs differ. ``forward_infer`` returns the full-vocabulary logits (all-gathered, an exact copy)
so the sampler sees the whole row, as vLLM's does.

Not done: the backward. The training forward's bits are the kernels' (recomputing logprobs under
``torch.no_grad()`` works), but gradients would need the collectives' own backward (all-reduce of the
column-parallel inputs' gradients, the vocab-parallel softmax gradient), so a forward that would build a
graph is refused rather than giving per-rank partial gradients. MoE layers and block-FP8 linears are
not sharded (refused).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hal import parallel
from hal.backend import Backend
from hal.errors import UnsupportedError
from hal.kvcache import PagedKVCache
from hal.model.config import ModelConfig
from hal.model.model import DecoderLM, InferenceBatch, _AutogradOps, _KernelOps
from hal.model.trace import OpTrace
from hal.parallel import TensorParallel

#: The linears whose reduced dim (K) is split across ranks; every other linear is column-parallel.
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def shard_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The sizes of one rank's shard of ``config``, or a refusal naming the size that does not divide."""
    n = tp.world_size
    if config.is_moe:
        raise UnsupportedError("tensor parallelism of MoE layers is not implemented (expert parallelism and a "
                               "sharded expert GEMM would need their own [parallel] rules); use TP = 1")
    if getattr(config, "fp8", None) is not None:
        raise UnsupportedError("tensor parallelism of block-FP8 linears is not implemented (a K shard would have "
                               "to hold whole [fp8] blocks and expose their scaled partials); use TP = 1")
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        if getattr(config, name) % n:
            raise UnsupportedError(f"tensor parallelism over {n} ranks: {name} = {getattr(config, name)} is not a "
                                   f"multiple of {n} (KV heads are not replicated across ranks here)")
    return config.replace(num_heads=config.num_heads // n, num_kv_heads=config.num_kv_heads // n,
                          intermediate_size=config.intermediate_size // n, vocab_size=config.vocab_size // n)


def _shard_of(name: str, full: torch.Tensor, config: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's piece of the full parameter ``name`` (vLLM names)."""
    n, r = tp.world_size, tp.rank

    def rows(t, start, size):
        return t.narrow(0, start + r * size, size)

    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        q, kv = config.q_size // n, config.kv_size // n
        return torch.cat([rows(full, 0, q), rows(full, config.q_size, kv), rows(full, config.q_size + config.kv_size, kv)])
    if name.endswith("mlp.gate_up_proj.weight"):
        i = config.intermediate_size // n
        return torch.cat([rows(full, 0, i), rows(full, config.intermediate_size, i)])
    if any(name.endswith(p + ".weight") for p in ROW_PARALLEL):
        k = full.shape[1] // n
        return full.narrow(1, r * k, k)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return rows(full, 0, config.vocab_size // n)
    return full                                      # norms: replicated


class _ParallelOps:
    """The model's ops with the row-parallel linears and the logprobs combined across ranks."""

    def __init__(self, backend: Backend, tp: TensorParallel):
        super().__init__(backend)
        self.tp = tp

    def linear(self, x, w, b=None, *, out_dtype=None, name=""):
        if name.endswith(ROW_PARALLEL):
            return parallel.row_parallel_linear(self.backend, self.tp, x, w, b, out_dtype=out_dtype)
        return super().linear(x, w, b, out_dtype=out_dtype, name=name)

    def token_logprobs(self, logits, ids, temperature, *, name=""):
        return parallel.vocab_parallel_token_logprobs(self.backend, self.tp, logits, ids, temperature)


class _ParallelKernelOps(_ParallelOps, _KernelOps):
    pass


class _ParallelAutogradOps(_ParallelOps, _AutogradOps):
    pass


class ParallelDecoderLM(DecoderLM):
    """Rank ``tp.rank``'s shard of a decoder LLM of ``config`` (the whole model's config)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, *, backend: Backend | None = None,
                 device: torch.device | str | None = None):
        super().__init__(shard_config(config, tp), backend=backend, device=device)
        self.tp = tp
        self._full_config = config

    @classmethod
    def from_full(cls, model: DecoderLM, tp: TensorParallel, *, backend: Backend | None = None) -> "ParallelDecoderLM":
        """This rank's shard of ``model``'s weights (copied), on ``backend`` (default: the model's)."""
        shard = cls(model.config, tp, backend=backend or model._backend, device=model.device)
        full = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in shard.named_parameters():
                piece = _shard_of(name, full[name], model.config, tp)
                if piece.shape != p.shape:
                    raise UnsupportedError(f"shard of {name}: {tuple(piece.shape)} for a parameter of "
                                           f"{tuple(p.shape)} (a bug in the layout; please report it)")
                p.copy_(piece)
            for name, module in model.named_modules():     # planted eps values (hal diff) travel too
                if hasattr(module, "eps"):
                    shard.get_submodule(name).eps = module.eps
        return shard

    @property
    def full_config(self) -> ModelConfig:
        return self._full_config

    def _op_set(self, backend: Backend, training: bool):
        parallel.check_contract(backend, "ParallelDecoderLM")
        return (_ParallelAutogradOps if training else _ParallelKernelOps)(backend, self.tp)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return parallel.vocab_parallel_embedding(self.tp, token_ids, self.model.embed_tokens.weight)

    @torch.no_grad()
    def forward_infer(self, batch: InferenceBatch, kv_caches: Sequence[PagedKVCache],
                      trace: OpTrace | None = None) -> torch.Tensor:
        """One engine step on this rank's heads and caches; fp32 logits (M, V) of the whole vocabulary."""
        return parallel.gather_vocab(self.tp, super().forward_infer(batch, kv_caches, trace))

    def forward_train(self, token_ids, seq_lens, **kwargs):
        """The training forward's bits (sharded logits (M, V / n)); refused where it would build a graph."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise UnsupportedError("ParallelDecoderLM: the tensor-parallel backward is not implemented (the "
                                   "collectives have no gradient here, so each rank would get partial gradients); "
                                   "run the forward under torch.no_grad() to recompute logprobs, or train at TP = 1")
        return super().forward_train(token_ids, seq_lens, **kwargs)

    def next_token_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        """The rollout's logprobs from full-vocabulary logits, computed vocab-parallel from this rank's columns."""
        v = self.config.vocab_size
        local = logits[:, self.tp.rank * v:(self.tp.rank + 1) * v]
        return parallel.vocab_parallel_token_logprobs(self.backend, self.tp, local, token_ids, temperature)


__all__ = ["ParallelDecoderLM", "ROW_PARALLEL", "shard_config"]
