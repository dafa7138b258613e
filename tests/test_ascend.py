"""The ascend backend without an NPU: probe reasons, the contract -> NPU-argument mapping, every NPU
call checked against the vendored op schemas (api_facts.toml), the settings applied and read back
(and refused when set too late), the cann path's host-side logic with stand-in ops, and the
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

from hal.backends.ascend import AscendBackend, api_facts, mapping, probe, settings, tiles
from hal.contract import load_contract
from hal.errors import HalError, UnsupportedError

CONTRACT = load_contract("bf16-dense-v1")    # the triton path's emulation runs it
ASCEND = load_contract("bf16-ascend-v1")     # the cann path realises this one
FIA = "npu_fused_infer_attention_score_batch_invariant"


def replace(contract, section, **values):
    return dataclasses.replace(contract, **{section: dataclasses.replace(getattr(contract, section), **values)})


# ---------------------------------------------------------------------------------------------
# Probe
# ---------------------------------------------------------------------------------------------

def test_importing_the_backend_is_cheap():
    code = ("import sys, hal.backends.ascend as a; a.AscendBackend\n"
            "print(sorted(m for m in ('torch_npu', 'triton', 'batch_invariant_ops', 'flash_attn_npu_3') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_here_is_unavailable_and_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("HAL_ASCEND_PATH", raising=False)
    monkeypatch.delenv("HAL_ASCEND_ATTENTION", raising=False)
    p = AscendBackend.probe()
    assert not p.available
    assert p.reason.startswith("torch_npu is not importable")
    assert p.details["path"] == "cann" and p.details["attention_impl"] == "fia_batch_invariant"
    assert p.details["verified_on_hardware"] is False
    text = " | ".join(p.details["missing"])
    for piece in ("torch_npu", "CANN toolkit", "batch-invariant op package", "NPU device"):
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
        "torch_npu": _module("torch_npu", __version__="2.9.0.fake", npu=npu),
        "batch_invariant_ops": _module("batch_invariant_ops"),
        "flash_attn_npu_3": _module("flash_attn_npu_3", flash_attn_with_kvcache=lambda *a, **k: None),
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
    assert p.details["path"] == "cann" and p.details["attention_impl"] == "fia_batch_invariant"
    assert p.details["devices"] == 2 and p.details["verified_on_hardware"] is False


@pytest.mark.parametrize("remove, expected", [
    ("torch_npu", "torch_npu is not importable"),
    ("cann_env", "the CANN toolkit environment is not set"),
    ("batch_invariant_ops", "the CANN batch-invariant op package is not importable"),
    ("op:npu_mm_batch_invariant", "lacks torch.ops.batch_invariant_ops.npu_mm_batch_invariant"),
    ("op:" + FIA, "lacks torch.ops.batch_invariant_ops." + FIA),
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


def test_flash_attention_npu_is_looked_up_under_its_new_name_and_refused(stack):
    """Finding 2: the module is flash_attn_npu_3; it realises no shipped contract (512-key steps)."""
    assert probe.FLASH_MODULE == "flash_attn_npu_3" == api_facts.flash_module()["old_name"].replace("_v3", "_3")
    stack.monkeypatch.setenv("HAL_ASCEND_ATTENTION", "flash_attn_npu_3")
    p = AscendBackend.probe()
    assert not p.available and "512 keys" in p.reason and p.details["flash_attn_npu_3"] == "present"
    with pytest.raises(UnsupportedError, match="512 keys"):
        mapping.attention_args(ASCEND, "flash_attn_npu_3", num_q_heads=8, num_kv_heads=2, head_dim=128,
                               scale=0.1, max_seq_len=100)
    with pytest.raises(UnsupportedError, match="HAL_ASCEND_ATTENTION"):
        probe.resolve_attention_impl("flash_attn_npu_v3")  # the old name is not accepted silently


def test_the_triton_path_is_refused_on_an_npu_with_the_reasons(stack):
    """Finding 6: triton-ascend cannot keep the kernels' rounding; only the CPU emulation runs."""
    stack.monkeypatch.setenv("HAL_ASCEND_PATH", "triton")
    stack.monkeypatch.setitem(sys.modules, "batch_invariant_ops", None)  # not needed by the triton path
    p = AscendBackend.probe()
    assert not p.available and "triton.backends.ascend" in p.details["triton"]
    for reason in ("enable_fp_fusion", "tl.div_rn", "uint32 bitcast", "TensorDescriptor",
                   "TypeRange with null types"):
        assert reason in p.reason, reason
    with pytest.raises(UnsupportedError, match="tl.div_rn and tl.sqrt_rn"):
        AscendBackend(CONTRACT, None, path="triton", settings_surface=fake_surface())
    stack.monkeypatch.setenv("HAL_ASCEND_PATH", "cuda")
    p = AscendBackend.probe()
    assert not p.available and "HAL_ASCEND_PATH" in p.reason


# ---------------------------------------------------------------------------------------------
# The vendored API facts and the signature checks
# ---------------------------------------------------------------------------------------------

def test_every_vendored_fact_names_its_source_and_version():
    f = api_facts.facts()
    entries = [*f["op"].values(), *f["setting"].values(), *f["module"].values(), f["triton_ascend"],
               f["triton_ascend_compile"]]
    for entry in entries:
        assert entry["source"] and entry["version"] and isinstance(entry["confirmed"], bool), entry
    for name in f["op"]:
        entry = api_facts.op(name)
        assert "positional" in entry and "keywords" in entry, name


def test_the_signature_check_rejects_what_the_ops_would_reject():
    q = torch.zeros(2, 2, 4, 64)   # BSND, S = 2
    ok = dict(block_table=torch.zeros(2, 1), block_size=128, input_layout="BSND", num_heads=4,
              num_key_value_heads=4, scale=0.1, sparse_mode=3, inner_precise=0)
    api_facts.check_call(FIA, (q, q, q), ok)
    with pytest.raises(api_facts.ApiMismatch, match="'scale_value'.*'scale'"):             # finding 1
        api_facts.check_call(FIA, (q, q, q), {**{k: v for k, v in ok.items() if k != "scale"}, "scale_value": 0.1})
    with pytest.raises(api_facts.ApiMismatch, match="block_size in \\[128, 256, 384, 512\\]"):  # finding 1
        api_facts.check_call(FIA, (q, q, q), {**ok, "block_size": 64})
    api_facts.check_call(FIA, (q[:, :1], q, q), {**ok, "block_size": 64})  # S = 1 (IFA): the rule is for S > 1
    with pytest.raises(api_facts.ApiMismatch, match="no keyword 'num_splits'"):
        api_facts.check_call(FIA, (q, q, q), {**ok, "num_splits": 1})
    with pytest.raises(api_facts.ApiMismatch, match="sparse_mode=7"):
        api_facts.check_call(FIA, (q, q, q), {**ok, "sparse_mode": 7})
    with pytest.raises(api_facts.ApiMismatch, match="positional"):
        api_facts.check_call("npu_mm_batch_invariant", (q,), {})
    with pytest.raises(api_facts.ApiMismatch, match="not in api_facts.toml"):
        api_facts.check_call("npu_swiglu", (q,), {})


def test_inner_precise_is_documented_as_pinning_nothing_for_bf16():
    notes = api_facts.op("npu_fused_infer_attention_score")["notes"]
    assert "bfloat16 does not distinguish" in notes["inner_precise"]
    assert not any("inner_precise" in a for a in mapping.ATTENTION_ASSUMPTIONS)  # never claimed to pin anything


# ---------------------------------------------------------------------------------------------
# Contract -> NPU op arguments
# ---------------------------------------------------------------------------------------------

def test_gemm_mapping_pins_every_knob_and_follows_k_chunk():
    args = mapping.gemm_args(ASCEND)
    assert (args.op, args.k_chunk, args.operand_dtype, args.allow_hf32, args.weight_format) == (
        "torch.ops.batch_invariant_ops.npu_mm_batch_invariant", 512, "float32", False, "ND")
    other = mapping.gemm_args(replace(ASCEND, "gemm", k_chunk=256))
    assert other.k_chunk == 256 and other != args
    with pytest.raises(UnsupportedError, match="k_chunk"):
        mapping.gemm_args(replace(ASCEND, "gemm", k_chunk=100))
    with pytest.raises(UnsupportedError, match=r"\[gemm\].bias"):
        mapping.gemm_args(replace(ASCEND, "gemm", bias="after_rounding"))


def test_attention_mapping_pins_every_knob_of_the_fused_inference_attention():
    args = mapping.attention_args(ASCEND, "fia_batch_invariant", num_q_heads=32, num_kv_heads=8, head_dim=128,
                                  scale=0.125, max_seq_len=2048)
    assert args["op"].endswith(FIA)
    pinned = {k: args[k] for k in ("input_layout", "min_query_s", "sparse_mode", "inner_precise", "block_size",
                                   "num_heads", "num_key_value_heads", "scale", "pre_tokens", "next_tokens",
                                   "softmax_lse_flag")}
    assert pinned == dict(input_layout="BSND", min_query_s=2, sparse_mode=3, inner_precise=0, block_size=128,
                          num_heads=32, num_key_value_heads=8, scale=0.125, pre_tokens=2 ** 31 - 1, next_tokens=0,
                          softmax_lse_flag=False)
    assert args["assumptions"], "what the arguments cannot pin must be listed"
    assert mapping.attention_args(replace(ASCEND, "attention", kv_chunk=256), "fia_batch_invariant",
                                  num_q_heads=32, num_kv_heads=8, head_dim=128, scale=0.125,
                                  max_seq_len=100)["block_size"] == 256
    # finding 1: a KV chunk that is no paged block size (64, 1024) is refused, never passed as block_size
    for chunk, split in ((64, 512), (1024, 2048)):
        with pytest.raises(UnsupportedError, match="block_size must be one of"):
            mapping.attention_args(replace(ASCEND, "attention", kv_chunk=chunk, kv_split=split),
                                   "fia_batch_invariant", num_q_heads=4, num_kv_heads=4, head_dim=64, scale=0.125,
                                   max_seq_len=100)
    with pytest.raises(UnsupportedError, match="kv_split"):
        mapping.attention_args(ASCEND, "fia_batch_invariant", num_q_heads=4, num_kv_heads=4, head_dim=64,
                               scale=0.125, max_seq_len=2049)
    with pytest.raises(UnsupportedError, match="head dim"):
        mapping.attention_args(ASCEND, "fia_batch_invariant", num_q_heads=4, num_kv_heads=4, head_dim=96,
                               scale=0.125, max_seq_len=10)


def test_the_dense_contract_is_refused_with_the_native_rule_named():
    """Findings 2 and 4: the native kernels use exp, sum fp32 P and npu_rms_norm's mean is sum x fl(1/n)."""
    with pytest.raises(UnsupportedError, match="natural exp|multiplies the scores"):
        mapping.check_contract(CONTRACT)
    with pytest.raises(UnsupportedError, match="sums the fp32 probabilities"):
        mapping.check_known(replace(ASCEND, "attention", row_sum="sum_of_rounded_p"), "attention")
    with pytest.raises(UnsupportedError, match=r"sum x fl\(1/n\)"):
        mapping.rms_norm_args(replace(ASCEND, "rms_norm", inv_rms="div_rn_sqrt_rn"), 4096, 1e-6)
    assert AscendBackend.capabilities.contracts == ("bf16-ascend-v1",)
    with pytest.raises(HalError, match="bf16-ascend-v1"):
        AscendBackend.check_realises(CONTRACT, AscendBackend.capabilities)


@pytest.mark.parametrize("section, key, value", [
    ("attention", "exp", "exp2"), ("attention", "gqa", "interleaved"), ("rms_norm", "inv_rms", "rsqrt"),
    ("silu_mul", "exp", "exp2"), ("logprobs", "temperature", "multiply"), ("topk", "ties", "any"),
])
def test_an_unknown_contract_value_is_refused_never_ignored(section, key, value):
    with pytest.raises(UnsupportedError, match=rf"\[{section}\]\.{key}"):
        mapping.check_contract(replace(ASCEND, section, **{key: value}))


def test_row_mappings_follow_the_contract_widths():
    assert mapping.reduce_args(ASCEND, 10000)["blocks"] == [(0, 4096), (4096, 8192), (8192, 10000)]
    assert mapping.reduce_args(replace(ASCEND, "reduce", row_block=8192), 10000)["blocks"] == [(0, 8192),
                                                                                            (8192, 10000)]
    assert len(mapping.logprobs_args(ASCEND, 152064)["chunks"]) == 38
    assert len(mapping.logprobs_args(replace(ASCEND, "logprobs", vocab_chunk=8192), 152064)["chunks"]) == 19
    args = mapping.rms_norm_args(ASCEND, 5120, 1e-6)
    assert args["op"] == "torch_npu.npu_rms_norm" and args["fused_add"] is False and args["epsilon"] == 1e-6
    assert "fl(1/n)" in args["mean"]
    with pytest.raises(UnsupportedError, match="row_block"):
        mapping.rms_norm_args(ASCEND, 8193, 1e-6)
    assert mapping.silu_mul_args(ASCEND)["fused_swiglu"] is False


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


def fake_surface(sticky=True, environ=None, modules=None, dist=False):
    class Matmul:
        _v = True

        @property
        def allow_hf32(self):
            return self._v

        @allow_hf32.setter
        def allow_hf32(self, value):
            if sticky:
                self._v = value

    options = {}
    npu = types.SimpleNamespace(matmul=Matmul(), conv=types.SimpleNamespace(allow_hf32=True),
                                config=types.SimpleNamespace(allow_internal_format=True),
                                set_option=options.update, options=options)
    return settings.Surface({"HCCL_DETERMINISTIC": "false"} if environ is None else environ,
                            types.SimpleNamespace(npu=npu), _FakeTorch(), modules or {}, lambda: dist)


def test_settings_are_applied_where_they_live_and_read_back():
    surface = fake_surface()
    before = settings.read_back(surface)
    assert before["torch_npu.npu.matmul.allow_hf32"] is True
    with pytest.raises(settings.SettingsError):
        settings.verify(before)
    readback = settings.apply_and_verify(surface)
    assert readback == settings.expected() and surface.environ["HCCL_DETERMINISTIC"] == "true"
    # finding 5: the precision mode is a set_option option, not an environment variable
    assert surface.torch_npu.npu.options == {"ACL_PRECISION_MODE": "must_keep_origin_dtype"}
    assert "ACL_PRECISION_MODE" not in surface.environ and api_facts.setting("ACL_PRECISION_MODE")["kind"] == "option"
    assert "not readable" in readback["option.ACL_PRECISION_MODE"]
    assert surface.environ["VLLM_ASCEND_ENABLE_NZ"] == "0" and surface.environ["LCCL_DETERMINISTIC"] == "1"
    assert surface.torch_npu.npu.config.allow_internal_format is False and surface.torch.det is True
    assert settings.apply_and_verify(fake_surface(), hccl="strict")["env.HCCL_DETERMINISTIC"] == "strict"
    with pytest.raises(settings.SettingsError, match="Atlas 800T A2"):
        settings.apply_and_verify(fake_surface(), hccl="yes")


def test_a_setting_that_does_not_stick_refuses_the_backend():
    with pytest.raises(settings.SettingsError, match="allow_hf32 = True"):
        settings.apply_and_verify(fake_surface(sticky=False))


def test_a_setting_read_before_it_was_set_refuses_the_backend():
    """Finding 5: HCCL reads its variables at communicator creation, vllm-ascend NZ at config build."""
    assert api_facts.setting("HCCL_DETERMINISTIC")["read_when"] == "communicator creation"
    with pytest.raises(settings.SettingsError, match="HCCL_DETERMINISTIC.*process group already exists"):
        settings.apply(fake_surface(dist=True))
    with pytest.raises(settings.SettingsError, match="VLLM_ASCEND_ENABLE_NZ.*vllm_ascend is already imported"):
        settings.apply(fake_surface(modules={"vllm_ascend": object()}))
    # exported in the launcher: nothing is late, so the same state is accepted
    ok = {"HCCL_DETERMINISTIC": "true", "LCCL_DETERMINISTIC": "1", "VLLM_ASCEND_ENABLE_NZ": "0"}
    assert settings.apply_and_verify(fake_surface(environ=dict(ok), modules={"vllm_ascend": 1}, dist=True))


def test_backend_reports_settings_and_mapping_with_the_fingerprint():
    b = AscendBackend(CONTRACT, "cpu", path="triton", settings_surface=fake_surface())
    report = b.numerics_report()
    assert report["fingerprint"] == CONTRACT.fingerprint and report["path"] == "triton"
    assert report["settings"] == settings.expected() and len(report["settings_fingerprint"]) == 64
    assert report["verified_on_hardware"] is False and report["emulated"] is True
    with pytest.raises(UnsupportedError, match="CPU device"):
        AscendBackend(ASCEND, "cpu", path="cann", settings_surface=fake_surface())


# ---------------------------------------------------------------------------------------------
# The cann path's host-side logic, with stand-in ops on the CPU (each call is schema-checked first)
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
        self.calls.append(("fia", q.shape, kwargs))
        return torch.full_like(q, 7.0), None


def test_cann_gemm_calls_the_op_once_per_k_chunk_in_fp32_and_adds_in_order():
    from hal.backends.ascend.cann_ops import CannOps

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1100, generator=g).bfloat16()
    w = torch.randn(7, 1100, generator=g).bfloat16()
    ops = _RecordingOps()
    out = CannOps(ASCEND, "fia_batch_invariant", ops=ops, torch_npu=object()).linear(x, w, None, torch.float32)
    assert [c[3] for c in ops.calls] == [512, 512, 76] and all(c[1] == c[2] == torch.float32 for c in ops.calls)
    expected = torch.zeros(3, 7)
    for s, e in ((0, 512), (512, 1024), (1024, 1100)):
        expected = expected + (x[:, s:e].double() @ w[:, s:e].double().T).float()
    assert torch.equal(out, expected)
    ops256 = _RecordingOps()
    CannOps(replace(ASCEND, "gemm", k_chunk=256), "fia_batch_invariant", ops=ops256,
            torch_npu=object()).linear(x, w, None, torch.float32)
    assert len(ops256.calls) == 5


def test_cann_rms_norm_calls_npu_rms_norm_with_its_documented_keyword():
    from hal.backends.ascend.cann_ops import CannOps

    seen = []

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        seen.append(epsilon)
        return x, x

    ops = CannOps(ASCEND, "fia_batch_invariant", ops=_RecordingOps(), torch_npu=types.SimpleNamespace(
        npu_rms_norm=npu_rms_norm))
    x = torch.randn(3, 64).bfloat16()
    out, res = ops.rms_norm(x, torch.ones(64).bfloat16(), 1e-5, x)
    assert seen == [1e-5] and torch.equal(res, (x.float() * 2).bfloat16())


def _attention_call(q_lens, kv_lens, page=5):
    from hal.backends.ascend.cann_ops import CannOps
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(1)
    pages = [-(-n // page) for n in kv_lens]
    tables, first = [], 0
    for n in pages:
        tables.append(list(range(first, first + n))[::-1])  # scrambled (reversed) pages
        first += n
    k_cache = torch.randn(first, page, 2, 64, generator=g).bfloat16()
    ops = _RecordingOps()
    q = torch.randn(sum(q_lens), 4, 64, generator=g).bfloat16()
    out = CannOps(ASCEND, "fia_batch_invariant", ops=ops, torch_npu=object()).attention(
        q, k_cache, k_cache.clone(), build_metadata(q_lens, kv_lens, tables), 0.125)
    assert out.shape == q.shape
    return ops.calls


def test_cann_attention_is_one_call_path_for_every_phase():
    """Finding 3: prefill, decode and a mixed batch are one BSND call with S >= 2, i.e. always the
    PromptFlashAttention branch, with the same arguments."""
    calls = {name: _attention_call(q, kv) for name, (q, kv) in dict(
        prefill=([47], [47]), chunked=([20], [47]), decode=([1, 1], [47, 130]), mixed=([1, 30], [47, 130])).items()}
    assert all(len(c) == 1 for c in calls.values())
    shapes = {name: c[0][1] for name, c in calls.items()}
    assert shapes == dict(prefill=(1, 47, 4, 64), chunked=(1, 20, 4, 64), decode=(2, 2, 4, 64),
                          mixed=(2, 30, 4, 64))
    assert all(s[1] > 1 for s in shapes.values()), "a query S of 1 would run IncreFlashAttention"
    fixed = ("input_layout", "sparse_mode", "inner_precise", "block_size", "num_heads", "num_key_value_heads",
             "scale", "pre_tokens", "next_tokens", "softmax_lse_flag")
    pinned = {name: tuple(c[0][2][k] for k in fixed) for name, c in calls.items()}
    assert len(set(pinned.values())) == 1 and pinned["decode"] == ("BSND", 3, 0, 128, 4, 2, 0.125, 2 ** 31 - 1,
                                                                   0, False)
    assert calls["mixed"][0][2]["actual_seq_lengths"] == [1, 30]
    assert calls["mixed"][0][2]["actual_seq_lengths_kv"] == [47, 130]
    assert "scale_value" not in calls["decode"][0][2]


def test_cann_attention_reblocks_the_cache_exactly_into_128_key_blocks():
    from hal.backends.ascend.cann_ops import reblock

    g = torch.Generator().manual_seed(1)
    page, pages = 5, [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]  # scrambled pages of 5 keys: 50 keys
    k_cache = torch.randn(10, page, 2, 64, generator=g).bfloat16()
    v_cache = torch.randn(10, page, 2, 64, generator=g).bfloat16()
    kb, vb, table = reblock(k_cache, v_cache, [47], [pages], 16)
    assert kb.shape == (3, 16, 2, 64) and table.tolist() == [[0, 1, 2]]
    for j in range(47):
        assert torch.equal(kb.view(-1, 2, 64)[j], k_cache[pages[j // page], j % page])
        assert torch.equal(vb.view(-1, 2, 64)[j], v_cache[pages[j // page], j % page])
    calls = _attention_call([1], [130])
    kwargs = calls[0][2]
    assert kwargs["block_size"] == 128 and kwargs["block_table"].shape == (1, 2)


def test_cann_attention_refuses_fp32_and_the_flash_kernel():
    from hal.backends.ascend.cann_ops import CannOps
    from hal.kvcache import build_metadata

    ops = CannOps(ASCEND, "fia_batch_invariant", ops=_RecordingOps(), torch_npu=object())
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(UnsupportedError, match="bf16"):
        ops.attention(torch.zeros(1, 4, 64), cache, cache, build_metadata([1], [20], [[0, 1]]), 0.125)
    with pytest.raises(UnsupportedError, match="512 keys"):
        CannOps(ASCEND, "flash_attn_npu_3", ops=_RecordingOps(), torch_npu=object())


# ---------------------------------------------------------------------------------------------
# triton-ascend tile configurations, run by Triton's interpreter
# ---------------------------------------------------------------------------------------------

def test_ascend_tiles_fit_the_unified_buffer_and_keep_block_k_fixed():
    for in_bytes in (2, 4):
        cfgs = [tiles.gemm_config(m, n, 4096, CONTRACT.gemm, in_bytes) for m in (1, 16, 17, 64, 65, 4096)
                for n in (64, 4096, 152064)]
        assert len({c["BLOCK_K"] for c in cfgs}) == 1, "BLOCK_K must not depend on M or N"
        # the double-buffered budget (half the 192 KB UB), not the whole UB
        assert tiles.UB_BUDGET == tiles.UB_BYTES // 2 == api_facts.triton_ascend()["double_buffered_budget_bytes"]
        assert all(tiles.gemm_ub_bytes(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], in_bytes) <= tiles.UB_BUDGET
                   for c in cfgs)
        assert all(c["tma"] is False for c in cfgs), "triton-ascend has no host-side TensorDescriptor"
        for d in (64, 128):
            for group in (1, 4, 8):
                gp = 1 << (group - 1).bit_length()
                if tiles.attention_ub_bytes(gp, 64, d, in_bytes) > tiles.UB_BUDGET:  # not even one query fits
                    with pytest.raises(UnsupportedError, match="does not fit"):
                        tiles.attention_block_q(64, d, group, in_bytes, 4096)
                    assert in_bytes == 4 and d == 128, "bf16 tiles of 64 keys must fit"
                    continue
                bq = tiles.attention_block_q(64, d, group, in_bytes, 4096)
                assert tiles.attention_ub_bytes(bq * gp, 64, d, in_bytes) <= tiles.UB_BUDGET
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


def test_the_npu_smoke_script_calls_every_op_once_and_reads_back_every_setting():
    """The wiring of ``python -m hal.backends.ascend.smoke`` on stand-ins (its NPU run is not done)."""
    from hal.backends.ascend import smoke

    lines = []
    npu_rms_norm = lambda x, gamma, epsilon=1e-6: (x, x)  # noqa: E731
    ok = smoke.run(_RecordingOps(), types.SimpleNamespace(npu_rms_norm=npu_rms_norm), fake_surface(), "cpu",
                   out=lines.append)
    text = "\n".join(lines)
    assert ok, text
    for name in ("npu_mm_batch_invariant", "npu_reduce_sum_batch_invariant", "npu_rms_norm", FIA):
        assert f"== {name}" in text, name
    assert text.count("called once: ok") == 4
    for key in settings.expected():
        assert f"== setting {key}" in text, key
    assert not smoke.run(_RecordingOps(), types.SimpleNamespace(npu_rms_norm=npu_rms_norm),
                         fake_surface(sticky=False), "cpu", out=lines.append)  # control: a bad setting fails it
