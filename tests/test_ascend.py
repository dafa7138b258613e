"""The ascend backend without an NPU: probe reasons, the contract -> NPU-argument mapping, the
settings applied and read back, the cann path's host-side logic with stand-in ops, and the
triton-ascend tile configurations run by Triton's CPU interpreter.

Nothing here proves anything about NPU hardware (none is reachable): the probe, mapping and
settings are checked against fakes; the Ascend-shaped kernel launches are checked for bitwise
invariance under the interpreter, as the cuda kernels are in test_cuda_interpreter.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types

import pytest
import torch

from hal.backends.ascend import AscendBackend, mapping, probe, settings, tiles
from hal.contract import load_contract
from hal.errors import UnsupportedError

CONTRACT = load_contract("bf16-dense-v1")


def replace(contract, section, **values):
    return dataclasses.replace(contract, **{section: dataclasses.replace(getattr(contract, section), **values)})


# ---------------------------------------------------------------------------------------------
# Probe
# ---------------------------------------------------------------------------------------------

def test_importing_the_backend_is_cheap():
    code = ("import sys, hal.backends.ascend as a; a.AscendBackend\n"
            "print(sorted(m for m in ('torch_npu', 'triton', 'batch_invariant_ops', 'flash_attn_npu_v3') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_here_is_unavailable_and_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("HAL_ASCEND_PATH", raising=False)
    monkeypatch.delenv("HAL_ASCEND_ATTENTION", raising=False)
    p = AscendBackend.probe()
    assert not p.available
    assert p.reason.startswith("torch_npu is not importable")
    assert p.details["path"] == "cann" and p.details["verified_on_hardware"] is False
    text = " | ".join(p.details["missing"])
    for piece in ("torch_npu", "CANN toolkit", "batch-invariant op package", "flash-attention-npu", "NPU device"):
        assert piece in text, piece


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def stack(monkeypatch):
    """A fake, complete Ascend stack; tests remove one piece at a time."""
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
    mods = {
        "torch_npu": _module("torch_npu", __version__="2.6.0.fake", npu=npu),
        "batch_invariant_ops": _module("batch_invariant_ops"),
        "flash_attn_npu_v3": _module("flash_attn_npu_v3", flash_attn_with_kvcache=lambda *a, **k: None),
        "triton.backends.ascend": _module("triton.backends.ascend"),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    registered = set(probe.CANN_OPS) | {probe.FIA_OP}
    monkeypatch.setattr(probe, "lookup_op", lambda ns, name: object() if name in registered else None)
    for var in ("HAL_ASCEND_PATH", "HAL_ASCEND_ATTENTION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/opt/cann")
    return types.SimpleNamespace(mods=mods, npu=npu, registered=registered, monkeypatch=monkeypatch)


def test_probe_with_every_piece_present_is_available_and_reports_the_path(stack):
    p = AscendBackend.probe()
    assert p.available, p.reason
    assert p.details["path"] == "cann" and p.details["attention_impl"] == "flash_attn_npu_v3"
    assert p.details["devices"] == 2 and p.details["verified_on_hardware"] is False
    stack.monkeypatch.setenv("HAL_ASCEND_PATH", "triton")
    stack.monkeypatch.setitem(sys.modules, "batch_invariant_ops", None)  # not needed by the triton path
    p = AscendBackend.probe()
    assert p.available and p.details["path"] == "triton" and "triton.backends.ascend" in p.details["triton"]


@pytest.mark.parametrize("remove, expected", [
    ("torch_npu", "torch_npu is not importable"),
    ("cann_env", "the CANN toolkit environment is not set"),
    ("batch_invariant_ops", "the CANN batch-invariant op package is not importable"),
    ("op:npu_mm_batch_invariant", "lacks torch.ops.batch_invariant_ops.npu_mm_batch_invariant"),
    ("flash_attn_npu_v3", "flash-attention-npu is not importable"),
    ("device", "no NPU device is visible"),
])
def test_probe_names_the_one_missing_piece(stack, remove, expected):
    if remove == "cann_env":
        stack.monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
        stack.monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    elif remove.startswith("op:"):
        stack.registered.discard(remove[3:])
    elif remove == "device":
        stack.npu.is_available = lambda: False
    else:
        stack.monkeypatch.setitem(sys.modules, remove, None)  # import raises ImportError
    p = AscendBackend.probe()
    assert not p.available
    assert len(p.details["missing"]) == (2 if remove == "torch_npu" else 1), p.details["missing"]
    assert p.details["missing"][0].startswith(expected) or expected in p.reason


def test_probe_follows_the_chosen_path_and_attention_kernel(stack):
    stack.monkeypatch.setenv("HAL_ASCEND_ATTENTION", "fia_batch_invariant")
    stack.monkeypatch.setitem(sys.modules, "flash_attn_npu_v3", None)
    assert AscendBackend.probe().available  # flash-attention-npu is not needed for FIA
    stack.registered.discard(probe.FIA_OP)
    assert probe.FIA_OP in AscendBackend.probe().reason
    stack.monkeypatch.setenv("HAL_ASCEND_PATH", "triton")
    stack.monkeypatch.setitem(sys.modules, "triton.backends.ascend", None)
    stack.monkeypatch.setitem(sys.modules, "triton.backends.cann", None)
    p = AscendBackend.probe()
    assert not p.available and "is not triton-ascend" in p.reason and "batch-invariant" not in p.reason
    stack.monkeypatch.setenv("HAL_ASCEND_PATH", "cuda")
    p = AscendBackend.probe()
    assert not p.available and "HAL_ASCEND_PATH" in p.reason


# ---------------------------------------------------------------------------------------------
# Contract -> NPU op arguments
# ---------------------------------------------------------------------------------------------

def test_gemm_mapping_pins_every_knob_and_follows_k_chunk():
    args = mapping.gemm_args(CONTRACT)
    assert (args.op, args.k_chunk, args.operand_dtype, args.allow_hf32, args.weight_format) == (
        "torch.ops.batch_invariant_ops.npu_mm_batch_invariant", 512, "float32", False, "ND")
    other = mapping.gemm_args(replace(CONTRACT, "gemm", k_chunk=256))
    assert other.k_chunk == 256 and other != args
    with pytest.raises(UnsupportedError, match="k_chunk"):
        mapping.gemm_args(replace(CONTRACT, "gemm", k_chunk=100))
    with pytest.raises(UnsupportedError, match=r"\[gemm\].bias"):
        mapping.gemm_args(replace(CONTRACT, "gemm", bias="after_rounding"))


def test_attention_mapping_pins_every_knob_of_the_fused_inference_attention():
    args = mapping.attention_args(CONTRACT, "fia_batch_invariant", num_q_heads=32, num_kv_heads=8, head_dim=128,
                                  scale=0.125, max_seq_len=512)
    assert args["op"].endswith("npu_fused_infer_attention_score_batch_invariant")
    pinned = {k: args[k] for k in ("input_layout", "sparse_mode", "inner_precise", "block_size", "num_heads",
                                   "num_key_value_heads", "scale_value", "pre_tokens", "next_tokens",
                                   "softmax_lse_flag")}
    assert pinned == dict(input_layout="TND", sparse_mode=3, inner_precise=0, block_size=64, num_heads=32,
                          num_key_value_heads=8, scale_value=0.125, pre_tokens=2 ** 31 - 1, next_tokens=0,
                          softmax_lse_flag=False)
    assert args["assumptions"], "what the arguments cannot pin must be listed"
    # kv_chunk reaches block_size; a block size the kernel lacks is refused.
    assert mapping.attention_args(replace(CONTRACT, "attention", kv_chunk=128, kv_split=512), "fia_batch_invariant",
                                  num_q_heads=32, num_kv_heads=8, head_dim=128, scale=0.125,
                                  max_seq_len=100)["block_size"] == 128
    with pytest.raises(UnsupportedError, match="block_size"):
        mapping.attention_args(replace(CONTRACT, "attention", kv_chunk=1024, kv_split=0), "fia_batch_invariant",
                               num_q_heads=4, num_kv_heads=4, head_dim=64, scale=0.125, max_seq_len=100)


def test_attention_mapping_for_flash_attention_npu_and_the_split_rule():
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, scale=0.125)
    # flash-attention-npu's KV block is 128 keys: kv_chunk 64 cannot be realised.
    with pytest.raises(UnsupportedError, match="kv_chunk = 64"):
        mapping.attention_args(CONTRACT, "flash_attn_npu_v3", max_seq_len=100, **kw)
    c128 = replace(CONTRACT, "attention", kv_chunk=128, kv_split=512)
    args = mapping.attention_args(c128, "flash_attn_npu_v3", max_seq_len=512, **kw)
    assert (args["num_splits"], args["pack_gqa"], args["page_block_size"], args["causal"], args["softmax_scale"],
            args["num_heads"], args["num_kv_heads"], args["window_size"]) == (1, False, 128, True, 0.125, 8, 2, (-1, -1))
    # One split (num_splits=1) realises kv_split only while the context fits in one split.
    with pytest.raises(UnsupportedError, match="kv_split"):
        mapping.attention_args(c128, "flash_attn_npu_v3", max_seq_len=513, **kw)
    no_split = replace(CONTRACT, "attention", kv_chunk=128, kv_split=0)
    assert mapping.attention_args(no_split, "flash_attn_npu_v3", max_seq_len=100_000, **kw)["num_splits"] == 1
    with pytest.raises(UnsupportedError, match="head dim"):
        mapping.attention_args(c128, "flash_attn_npu_v3", max_seq_len=10, **dict(kw, head_dim=96))
    with pytest.raises(UnsupportedError, match="multiple"):
        mapping.attention_args(c128, "flash_attn_npu_v3", max_seq_len=10, **dict(kw, num_kv_heads=3))


@pytest.mark.parametrize("section, key, value", [
    ("attention", "exp", "exp"), ("attention", "gqa", "interleaved"), ("rms_norm", "inv_rms", "rsqrt"),
    ("silu_mul", "exp", "exp2"), ("logprobs", "temperature", "multiply"), ("topk", "ties", "any"),
])
def test_an_unknown_contract_value_is_refused_never_ignored(section, key, value):
    with pytest.raises(UnsupportedError, match=rf"\[{section}\]\.{key}"):
        mapping.check_contract(replace(CONTRACT, section, **{key: value}))


def test_row_mappings_follow_the_contract_widths():
    assert mapping.reduce_args(CONTRACT, 10000)["blocks"] == [(0, 4096), (4096, 8192), (8192, 10000)]
    assert mapping.reduce_args(replace(CONTRACT, "reduce", row_block=8192), 10000)["blocks"] == [(0, 8192),
                                                                                              (8192, 10000)]
    assert len(mapping.logprobs_args(CONTRACT, 152064)["chunks"]) == 38
    assert len(mapping.logprobs_args(replace(CONTRACT, "logprobs", vocab_chunk=8192), 152064)["chunks"]) == 19
    args = mapping.rms_norm_args(CONTRACT, 4096, 1e-6)
    assert args["op"] == "torch_npu.npu_rms_norm" and args["fused_add"] is False and args["epsilon"] == 1e-6
    with pytest.raises(UnsupportedError, match="row_block"):
        mapping.rms_norm_args(CONTRACT, 5120, 1e-6)
    assert mapping.rms_norm_args(replace(CONTRACT, "rms_norm", row_block=8192), 5120, 1e-6)["blocks"] == 1
    assert mapping.silu_mul_args(CONTRACT)["fused_swiglu"] is False


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

class _FakeTorch:
    def __init__(self):
        self.det = False

    def use_deterministic_algorithms(self, flag):
        self.det = bool(flag)

    def are_deterministic_algorithms_enabled(self):
        return self.det


def fake_surface(sticky=True):
    class Matmul:
        _v = True

        @property
        def allow_hf32(self):
            return self._v

        @allow_hf32.setter
        def allow_hf32(self, value):
            if sticky:
                self._v = value

    npu = types.SimpleNamespace(matmul=Matmul(), conv=types.SimpleNamespace(allow_hf32=True),
                                config=types.SimpleNamespace(allow_internal_format=True))
    return settings.Surface({"HCCL_DETERMINISTIC": "false"}, types.SimpleNamespace(npu=npu), _FakeTorch())


def test_settings_are_applied_and_read_back():
    surface = fake_surface()
    before = settings.read_back(surface)
    assert before["torch_npu.npu.matmul.allow_hf32"] is True and before["env.ACL_PRECISION_MODE"] is None
    with pytest.raises(settings.SettingsError):
        settings.verify(before)
    readback = settings.apply_and_verify(surface)
    assert readback == settings.expected() and surface.environ["HCCL_DETERMINISTIC"] == "strict"
    assert surface.environ["ACL_PRECISION_MODE"] == "must_keep_origin_dtype"
    assert surface.environ["VLLM_ASCEND_ENABLE_NZ"] == "0" and surface.environ["LCCL_DETERMINISTIC"] == "1"
    assert surface.torch_npu.npu.config.allow_internal_format is False and surface.torch.det is True
    assert settings.apply_and_verify(fake_surface(), hccl="true")["env.HCCL_DETERMINISTIC"] == "true"


def test_a_setting_that_does_not_stick_refuses_the_backend():
    with pytest.raises(settings.SettingsError, match="allow_hf32 = True"):
        settings.apply_and_verify(fake_surface(sticky=False))


def test_backend_reports_settings_and_mapping_with_the_fingerprint():
    b = AscendBackend(CONTRACT, "cpu", path="triton", settings_surface=fake_surface())
    report = b.numerics_report()
    assert report["fingerprint"] == CONTRACT.fingerprint and report["path"] == "triton"
    assert report["settings"] == settings.expected() and len(report["settings_fingerprint"]) == 64
    assert report["verified_on_hardware"] is False and report["emulated"] is True
    with pytest.raises(UnsupportedError, match="CPU device"):
        AscendBackend(CONTRACT, "cpu", path="cann", settings_surface=fake_surface())


# ---------------------------------------------------------------------------------------------
# The cann path's host-side logic, with stand-in ops on the CPU
# ---------------------------------------------------------------------------------------------

class _RecordingOps:
    def __init__(self):
        self.calls = []

    def npu_mm_batch_invariant(self, a, b):
        self.calls.append(("mm", a.dtype, b.dtype, a.shape[1]))
        return (a.double() @ b.double()).float()

    def npu_reduce_sum_batch_invariant(self, x, dim, keepdim):
        self.calls.append(("sum", x.dtype, x.shape[-1]))
        return x.double().sum(dim, keepdim).float()

    def npu_fused_infer_attention_score_batch_invariant(self, q, k, v, **kwargs):
        self.calls.append(("fia", kwargs))
        return torch.zeros_like(q), None


def test_cann_gemm_calls_the_op_once_per_k_chunk_in_fp32_and_adds_in_order():
    from hal.backends.ascend.cann_ops import CannOps

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1100, generator=g).bfloat16()
    w = torch.randn(7, 1100, generator=g).bfloat16()
    ops = _RecordingOps()
    out = CannOps(CONTRACT, "fia_batch_invariant", ops=ops, torch_npu=object()).linear(x, w, None, torch.float32)
    assert [c[3] for c in ops.calls] == [512, 512, 76] and all(c[1] == c[2] == torch.float32 for c in ops.calls)
    expected = torch.zeros(3, 7)
    for s, e in ((0, 512), (512, 1024), (1024, 1100)):
        expected = expected + (x[:, s:e].double() @ w[:, s:e].double().T).float()
    assert torch.equal(out, expected)
    ops256 = _RecordingOps()
    CannOps(replace(CONTRACT, "gemm", k_chunk=256), "fia_batch_invariant", ops=ops256,
            torch_npu=object()).linear(x, w, None, torch.float32)
    assert len(ops256.calls) == 5


def test_cann_attention_passes_the_mapping_and_reblocks_the_cache_exactly():
    from hal.backends.ascend.cann_ops import CannOps, reblock
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(1)
    page, pages = 5, [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]  # scrambled pages of 5 keys: 50 keys
    k_cache = torch.randn(10, page, 2, 64, generator=g).bfloat16()
    v_cache = torch.randn(10, page, 2, 64, generator=g).bfloat16()
    kb, vb, table = reblock(k_cache, v_cache, [47], [pages], 16)
    assert kb.shape == (3, 16, 2, 64) and table.tolist() == [[0, 1, 2]]
    for j in range(47):
        assert torch.equal(kb.view(-1, 2, 64)[j], k_cache[pages[j // page], j % page])
        assert torch.equal(vb.view(-1, 2, 64)[j], v_cache[pages[j // page], j % page])
    ops = _RecordingOps()
    meta = build_metadata([3], [47], [pages])
    q = torch.randn(3, 4, 64, generator=g).bfloat16()
    CannOps(CONTRACT, "fia_batch_invariant", ops=ops, torch_npu=object()).attention(q, k_cache, v_cache, meta, 0.125)
    kwargs = ops.calls[0][1]
    assert (kwargs["sparse_mode"], kwargs["inner_precise"], kwargs["block_size"], kwargs["input_layout"],
            kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["actual_seq_lengths_kv"]) == (
        3, 0, 64, "TND", 4, 2, [47])


def test_cann_attention_calls_flash_attention_npu_with_one_split_and_no_heuristics():
    from hal.backends.ascend.cann_ops import CannOps
    from hal.kvcache import build_metadata

    seen = {}

    def flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs):
        seen.update(kwargs, k_shape=tuple(k_cache.shape))
        return torch.zeros_like(q)

    flash = types.SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache)
    c128 = replace(CONTRACT, "attention", kv_chunk=128, kv_split=512)
    ops = CannOps(c128, "flash_attn_npu_v3", ops=_RecordingOps(), torch_npu=object(), flash=flash)
    k_cache = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)
    meta = build_metadata([2, 1], [20, 100], [[0, 1], [2, 3, 4, 5, 6, 7, 0]])
    ops.attention(torch.zeros(3, 4, 64, dtype=torch.bfloat16), k_cache, k_cache.clone(), meta, 0.125)
    assert (seen["num_splits"], seen["pack_gqa"], seen["causal"], seen["softmax_scale"]) == (1, False, True, 0.125)
    assert seen["k_shape"] == (2, 128, 2, 64) and seen["page_table"].tolist() == [[0], [1]]
    assert seen["cache_seqlens"].tolist() == [20, 100] and seen["cu_seqlens_q"].tolist() == [0, 2, 3]
    with pytest.raises(UnsupportedError, match="bf16"):
        ops.attention(torch.zeros(3, 4, 64), k_cache.float(), k_cache.float(), meta, 0.125)


# ---------------------------------------------------------------------------------------------
# triton-ascend tile configurations, run by Triton's interpreter
# ---------------------------------------------------------------------------------------------

def test_ascend_tiles_fit_the_unified_buffer_and_keep_block_k_fixed():
    for in_bytes in (2, 4):
        cfgs = [tiles.gemm_config(m, n, 4096, CONTRACT.gemm, in_bytes) for m in (1, 16, 17, 64, 65, 4096)
                for n in (64, 4096, 152064)]
        assert len({c["BLOCK_K"] for c in cfgs}) == 1, "BLOCK_K must not depend on M or N"
        assert all(tiles.gemm_ub_bytes(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], in_bytes) <= tiles.UB_BYTES
                   for c in cfgs)
        for d in (64, 128):
            for group in (1, 4, 8):
                bq = tiles.attention_block_q(64, d, group, in_bytes, 4096)
                gp = 1 << (group - 1).bit_length()
                assert tiles.attention_ub_bytes(bq * gp, 64, d, in_bytes) <= tiles.UB_BYTES
    assert tiles.gemm_block_k(512, 2) == 256 and tiles.gemm_block_k(512, 4) == 128 and tiles.gemm_block_k(
        48, 2) == 16
    with pytest.raises(UnsupportedError):
        tiles.row_block_fits(65536)


@pytest.fixture(scope="module")
def emulated():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the interpreter tests run only without one")
    return AscendBackend(CONTRACT, "cpu", path="triton", settings_surface=fake_surface())


def test_ascend_gemm_tiles_are_batch_invariant_under_the_interpreter(emulated):
    from hal.backends.ascend.launch import ASCEND_LAUNCH
    from hal.conformance.checks import random_tensor, row_invariance
    from hal.kernels import gemm

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        rows = random_tensor((48, 1100), dtype, g, spread=4)
        w = random_tensor((40, 1100), dtype, g, spread=4, scale=1100 ** -0.5)
        # batch sizes straddle the M thresholds (16, 64): split-K vs direct, BLOCK_M 16/32/64
        assert row_invariance("linear", lambda x: emulated.linear(x, w), rows, [1, 2, 17, 33, 70], g) == []
        # every Ascend config (same BLOCK_K) gives the same bits on one input
        x = rows[:20]
        outs = [gemm.linear(x, w, None, torch.float32, CONTRACT.gemm,
                            tiles.gemm_config(m, 40, 1100, CONTRACT.gemm, x.element_size()), policy=ASCEND_LAUNCH)
                for m in (1, 20, 100)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        other = AscendBackend(replace(CONTRACT, "gemm", k_chunk=256), "cpu", path="triton")
        assert not torch.equal(emulated.linear(x, w, out_dtype=torch.float32), other.linear(x, w, out_dtype=torch.float32))


def test_ascend_attention_tiles_keep_prefill_chunked_and_decode_bitwise_equal(emulated):
    from hal.conformance.checks import AttentionCase, attention_phases

    # kv_split 128 so a 140-token sequence crosses both a KV chunk (64) and a split boundary.
    b = AscendBackend(replace(CONTRACT, "attention", kv_chunk=64, kv_split=128), "cpu", path="triton")
    case = AttentionCase(140, 4, 2, 64, torch.bfloat16, seed=2)
    assert attention_phases(b, case, cuts=[33, 64, 129], page_sizes=[16, 5], decode_from=126, mates=2) == []


def test_ascend_row_ops_are_batch_invariant_under_the_interpreter(emulated):
    from hal.conformance.checks import op_row_functions, random_tensor, row_invariance

    g = torch.Generator().manual_seed(3)
    rows = random_tensor((24, 130), torch.bfloat16, g, spread=2)
    fns = op_row_functions(emulated, 130, 24, torch.bfloat16, g)
    for name in ("rms_norm", "rms_norm+residual", "silu_mul", "rotary", "log_softmax", "log_softmax T=0.7",
                 "token_logprobs", "sum", "mean", "topk"):
        assert row_invariance(name, fns[name], rows, [1, 5, 24], g, distinct=24) == [], name
