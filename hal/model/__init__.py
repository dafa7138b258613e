"""One decoder-LLM definition (Llama / Qwen2 / Qwen3) for training and rollout on HAL ops.

    from hal.model import DecoderLM, tiny_config, load_pretrained
    model = DecoderLM.random(tiny_config("qwen3", "bfloat16"), seed=0)   # or load_pretrained(path)
    logprobs = model.sequence_logprobs([[1, 5, 9, 2]], response_starts=[2])   # training mode

See ``hal.model.model`` for the weight layout and the two modes, ``hal.model.autograd`` for how
gradients are attached to inference kernels, ``hal.rollout`` for the generation harness.
"""

from hal.model.autograd import WeightsChangedError, straight_through
from hal.model.checkpoint import CheckpointError, load_pretrained, save_pretrained
from hal.model.config import ARCHITECTURES, Fp8Quantization, ModelConfig, read_hf_config, tiny_config, tiny_fp8_config
from hal.model.model import DecoderLM, InferenceBatch
from hal.model.trace import OpTrace, TraceEntry

__all__ = [
    "ARCHITECTURES", "CheckpointError", "DecoderLM", "Fp8Quantization", "InferenceBatch", "ModelConfig", "OpTrace", "TraceEntry",
    "WeightsChangedError", "load_pretrained", "read_hf_config", "save_pretrained", "straight_through", "tiny_config",
    "tiny_fp8_config",
]
