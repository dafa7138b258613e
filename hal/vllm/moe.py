"""Mixture-of-experts layers of a HAL-bound vLLM engine: the router GEMM and vLLM's FusedMoE.

vLLM's Qwen3-MoE block hands its ``GateLinear`` (the router) to the FusedMoE layer, whose runner calls
the gate, then the quant method. Two routes make the layer the trainer's ``hal.model`` MoE block:

* ``HalRouterMethod`` (in ``hal.vllm.quant``): the gate is the HAL linear with fp32 output ([moe].router_logits = fp32_gemm;
  a stock gate rounds the logits to bf16, which moves ties and near-ties between experts);
* ``HalFusedMoEMethod``: a *monolithic* FusedMoE method (vLLM hands it the router logits and does no
  routing of its own): ``torch.ops.hal.moe_route`` then ``torch.ops.hal.moe_experts`` on the bound
  backend, with the layer's plain stacked weights (w13 (E, 2I, H) rows [gate | up], w2 (E, H, I), as
  vLLM loads them; nothing repacked);
* ``HalFp8FusedMoEMethod`` (a block-FP8 checkpoint's experts): the same, with the e4m3 weights and their
  per-expert block scales (``w13_weight_scale_inv`` (E, 2I/B, H/B), ``w2_weight_scale_inv`` (E, H/B, I/B),
  the names and layout vLLM's own Fp8MoEMethod gives them, loaded by FusedMoE's block-scale loader) kept
  as loaded, and ``torch.ops.hal.fp8_moe_experts``.

What vLLM would compute outside the HAL is refused when the layer is built: expert or tensor
parallelism (partial expert sets), bias on the experts, an activation other than SiLU-and-multiply,
shared experts (vLLM adds them to the routed output after its rounding; the contract adds them
before), a custom routing function, routed_scaling_factor != 1 (vLLM scales the rounded output; the
contract scales the weights), routing weights applied on the input.

Imports vLLM: imported by ``hal.vllm.quant``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from hal.errors import UnsupportedError

if TYPE_CHECKING:
    from hal.vllm.quant import HalConfig


def _shared_experts(hf_config) -> int:
    """Shared-expert width of the model (Qwen2/3-MoE ``shared_expert_intermediate_size``, DeepSeek
    ``n_shared_experts``): vLLM runs them in the MoE runner, beside the routed experts."""
    return int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) + \
        int(getattr(hf_config, "n_shared_experts", 0) or 0)


def _refusals(layer, hf_config) -> list[str]:
    """Why vLLM's FusedMoE ``layer`` of the model ``hf_config`` would compute something the contract does
    not say (empty: none). The layer's attributes are read directly (no defaults): a vLLM that renamed
    one fails here, loudly."""
    moe = layer.moe_config
    reasons = []
    activation = getattr(moe.activation, "value", moe.activation)
    if str(activation) != "silu" or not moe.is_act_and_mul:
        reasons.append(f"activation {activation!r} (the contract's expert MLP is silu(gate) * up)")
    if moe.has_bias:
        reasons.append("bias on the expert projections")
    if layer.global_num_experts != layer.local_num_experts:
        reasons.append("expert parallelism (each rank holds some experts; the combine would be split)")
    if moe.tp_size != 1 or moe.ep_size != 1:
        reasons.append(f"tensor/expert parallel size {moe.tp_size}/{moe.ep_size}")
    if _shared_experts(hf_config):
        reasons.append("shared experts (vLLM adds them after rounding the routed output)")
    if layer.custom_routing_function is not None:
        reasons.append("a custom routing function")
    if float(layer.routed_scaling_factor) != 1.0:
        reasons.append(f"routed_scaling_factor {layer.routed_scaling_factor} (vLLM scales the rounded output)")
    if layer.apply_router_weight_on_input:
        reasons.append("routing weights applied to the input")
    # Routing switches the model's config.json asks for but vLLM's layer was not built with (vLLM's
    # Qwen3-MoE reads none of DeepSeek's): the trainer would honour them and the engine not.
    asked = {"scoring_func": getattr(hf_config, "scoring_func", None) or "softmax",
             "grouped top-k": (getattr(hf_config, "n_group", None) or 1) > 1,
             "correction bias": getattr(hf_config, "topk_method", None) == "noaux_tc",
             "routed_scaling_factor": float(getattr(hf_config, "routed_scaling_factor", None) or 1.0)}
    built = {"scoring_func": str(layer.scoring_func), "grouped top-k": bool(layer.use_grouped_topk),
             "correction bias": layer.e_score_correction_bias is not None,
             "routed_scaling_factor": float(layer.routed_scaling_factor)}
    reasons += [f"config.json asks for {key} = {asked[key]!r} but vLLM's layer was built with {built[key]!r}"
                for key in asked if asked[key] != built[key]]
    return reasons


class HalFusedMoEMethod(FusedMoEMethodBase):
    """vLLM's FusedMoE on the HAL: monolithic (vLLM passes the router logits), weights as loaded."""

    def __init__(self, config: "HalConfig", layer, prefix: str):
        super().__init__(layer.moe_config)
        reasons = _refusals(layer, get_current_vllm_config().model_config.hf_config)
        if reasons:
            raise UnsupportedError(f"hal vLLM plugin: MoE layer {prefix!r} cannot run under the contract's [moe]: "
                                   f"{'; '.join(reasons)}")
        self.config = config

    # The weights are created exactly as vLLM's unquantized method creates them (so its loaders and
    # checkpoints fit); unlike it, nothing is repacked after loading.
    create_weights = UnquantizedFusedMoEMethod.create_weights

    def process_weights_after_loading(self, layer) -> None:
        return None

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG

    @property
    def is_monolithic(self) -> bool:
        return True

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        raise UnsupportedError("hal vLLM plugin: the HAL's FusedMoE method routes the tokens itself (monolithic); "
                               "vLLM's precomputed routing is not used")

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        weights, ids = self._route(layer, router_logits)
        return torch.ops.hal.moe_experts(self.config.op_key, x, layer.w13_weight, layer.w2_weight, weights, ids, None)

    def _route(self, layer, router_logits):
        if router_logits.dtype != torch.float32:
            raise UnsupportedError(f"hal vLLM plugin: MoE layer got {router_logits.dtype} router logits; the "
                                   f"contract's router is an fp32 GEMM (the gate's HAL route gives fp32)")
        key = self.config.op_key
        scoring = str(getattr(layer, "scoring_func", "softmax"))
        groups = int(layer.num_expert_group or 1) if getattr(layer, "use_grouped_topk", False) else 1
        topk_groups = int(layer.topk_group or 1) if groups > 1 else 1
        return torch.ops.hal.moe_route(key, router_logits, getattr(layer, "e_score_correction_bias", None),
                                       router_logits.shape[-1], int(layer.top_k), scoring,
                                       bool(layer.renormalize), groups, topk_groups, 1.0)


class HalFp8FusedMoEMethod(HalFusedMoEMethod):
    """Block-FP8 experts on the HAL: e4m3 ``w13_weight`` / ``w2_weight`` with their block scales, as loaded."""

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
        from vllm.model_executor.utils import set_weight_attrs

        rows, cols = self.config.fp8["weight_block_size"]
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        for what, size in (("hidden size", h), ("expert intermediate size", i)):
            if size % rows or size % cols:
                raise UnsupportedError(f"hal vLLM plugin: FP8 experts need whole {rows} x {cols} weight blocks; the "
                                       f"{what} is {size}")
        for name, (n, k) in (("w13_weight", (2 * i, h)), ("w2_weight", (h, i))):
            weight = torch.nn.Parameter(torch.empty(e, n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
            layer.register_parameter(name, weight)
            set_weight_attrs(weight, extra_weight_attrs)
            scale = torch.nn.Parameter(torch.empty(e, n // rows, k // cols, dtype=torch.float32), requires_grad=False)
            layer.register_parameter(name + "_scale_inv", scale)
            # FusedMoE's loader puts a block scale where it puts the weight (gate / up halves of w13).
            set_weight_attrs(scale, {**extra_weight_attrs, "quant_method": FusedMoeWeightScaleSupported.BLOCK.value})

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        weights, ids = self._route(layer, router_logits)
        return torch.ops.hal.fp8_moe_experts(self.config.op_key, x, layer.w13_weight, layer.w13_weight_scale_inv,
                                             layer.w2_weight, layer.w2_weight_scale_inv, weights, ids, None)

