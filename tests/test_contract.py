"""Contract loading, every validation error, and the fingerprint's stability."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import resources

import pytest

from hal.contract import available_contracts, load_contract, parse_contract
from hal.errors import ContractError, UnknownContractError

SHIPPED = resources.files("hal.contracts").joinpath("bf16-dense-v1.toml").read_text()


def edited(old: str, new: str) -> str:
    assert old in SHIPPED, f"test setup: {old!r} not in the shipped contract"
    return SHIPPED.replace(old, new, 1)


def test_shipped_contract_loads_with_its_numbers():
    c = load_contract("bf16-dense-v1")
    assert c.name == "bf16-dense-v1" and c.version == 1
    assert c.gemm.k_chunk == 512 and c.attention.kv_chunk == 64 and c.attention.kv_split == 512
    assert "bf16-dense-v1" in available_contracts()
    assert re.fullmatch(r"[0-9a-f]{64}", c.fingerprint)


def test_fingerprint_is_the_same_in_another_process_and_hash_seed():
    here = load_contract().fingerprint
    code = "from hal.contract import load_contract; print(load_contract().fingerprint)"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == here


def test_fingerprint_ignores_comments_and_key_order_but_not_values():
    base = parse_contract(SHIPPED).fingerprint
    reordered = edited("k_chunk = 512\n", "") .replace("[gemm]\n", "[gemm]\nk_chunk = 512  # moved\n", 1)
    assert parse_contract("# a new comment\n" + reordered).fingerprint == base
    assert parse_contract(edited("k_chunk = 512", "k_chunk = 256")).fingerprint != base
    assert parse_contract(edited("kv_split = 512", "kv_split = 0")).fingerprint != base


@pytest.mark.parametrize("text, key, found, expected", [
    (edited("k_chunk = 512", "k_chunk = 512\nk_chunks = 4"), "[gemm].k_chunks", "4", "no such key"),
    (edited("k_chunk = 512", 'k_chunk = "512"'), "[gemm].k_chunk", "'512'", "an integer"),
    (edited("k_chunk = 512", "k_chunk = true"), "[gemm].k_chunk", "True", "an integer"),
    (edited("k_chunk = 512", "k_chunk = 100"), "[gemm].k_chunk", "100", "a positive multiple of 16"),
    (edited("k_chunk = 512\n", ""), "[gemm].k_chunk", "'<missing>'", "a positive multiple of 16"),
    (edited('exp = "exp2"', 'exp = "exp"'), "[attention].exp", "'exp'", "'exp2'"),
    (edited("kv_chunk = 64", "kv_chunk = 48"), "[attention].kv_chunk", "48", "a power of two"),
    (edited("kv_split = 512", "kv_split = 96"), "[attention].kv_split", "96",
     "0 or a multiple of [attention].kv_chunk (64)"),
    (edited('activation_dtypes = ["bfloat16", "float32"]', 'activation_dtypes = ["float8"]'),
     "[contract].activation_dtypes", "['float8']", "'bfloat16', 'float32'"),
    (edited("[topk]", "[sampling]\nseed = 1\n\n[topk]"), "[sampling]", "'<table>'", "one of the sections"),
    (SHIPPED[: SHIPPED.index("[topk]")], "[topk]", "'<missing>'", "the section to be present"),
    ("[gemm\n", "<file>", "'invalid TOML'", "valid TOML"),
])
def test_every_validation_error_names_file_key_found_and_expected(text, key, found, expected):
    with pytest.raises(ContractError) as info:
        parse_contract(text, source="contracts/broken.toml")
    message = str(info.value)
    assert message.startswith(f"contracts/broken.toml: {key} = {found}: expected "), message
    assert expected in message, message


def test_contract_file_by_path_and_name_mismatch(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(edited("k_chunk = 512", "k_chunk = 1024"))
    c = load_contract(str(path))
    assert c.gemm.k_chunk == 1024 and c.source == str(path)
    path.write_text(edited("k_chunk = 512", "k_chunk = 7"))
    with pytest.raises(ContractError, match=re.escape(f"{path}: [gemm].k_chunk = 7")):
        load_contract(str(path))


def test_unknown_contract_lists_the_shipped_ones():
    with pytest.raises(UnknownContractError, match="shipped contracts: .*bf16-dense-v1"):
        load_contract("fp8-everything")
    with pytest.raises(UnknownContractError, match="cannot read contract file"):
        load_contract("/nonexistent/contract.toml")


@pytest.mark.parametrize("content, found", [
    (b"\xff\xfe[contract]\n", "not UTF-8"),
    (b"", "an empty file"),
    (b"  \n# only a comment\n", "an empty file"),
])
def test_unreadable_or_empty_contract_file_is_a_contract_error(tmp_path, content, found):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    with pytest.raises(ContractError, match=found) as info:
        load_contract(path)
    assert str(path) in str(info.value) and "expected" in str(info.value)


def test_cli_reports_a_bad_contract_file_in_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"\x80\x81 binary")
    run = subprocess.run([sys.executable, "-m", "hal.cli", "contract", "show", str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("hal: error:") and len(run.stderr.strip().splitlines()) == 1


# -- the rules derived from the contract's values, written once on the sections ---------------------

def _variant(section: str, **values):
    import dataclasses

    c = load_contract()
    return dataclasses.replace(c, **{section: dataclasses.replace(getattr(c, section), **values)})


def test_kv_split_zero_means_one_split_over_the_whole_context():
    split = _variant("attention", kv_chunk=64, kv_split=512).attention
    assert [split.split_size(n) for n in (1, 512, 100_000)] == [512, 512, 512]
    assert [split.split_count(n) for n in (1, 512, 513, 1025)] == [1, 1, 2, 3]
    none = _variant("attention", kv_chunk=64, kv_split=0).attention
    # one split covering the context, in whole KV chunks (never 0, so a kernel can divide by it)
    assert [none.split_size(n) for n in (0, 1, 64, 65, 100_000)] == [64, 64, 64, 128, 100_032]
    assert {none.split_count(n) for n in (0, 1, 65, 100_000)} == {1}


def test_folded_scale_is_the_fp64_quotient_rounded_once_to_fp32():
    import math

    import numpy as np

    attention = load_contract().attention
    for scale in (1.0, 0.125, 64 ** -0.5, 96 ** -0.5, 128 ** -0.5, 0.1, 3.7e-3):
        folded = attention.folded_scale(scale)
        assert folded == float(np.float32(scale / math.log(2.0)))   # nearest fp32 of the fp64 quotient
        assert float(np.float32(folded)) == folded                 # an fp32 value, exactly
    # negative control: rounding the scale and log2 e to fp32 first and multiplying in fp32 gives other
    # bits at head dim 80's scale (the two agree at 64, 96 and 128)
    scale = 80 ** -0.5
    assert attention.folded_scale(scale) != float(np.float32(np.float32(scale) * np.float32(1 / math.log(2.0))))


def test_chunk_counts_and_ranges_cover_the_reduced_dim_at_absolute_offsets():
    c = _variant("gemm", k_chunk=512)
    assert [c.gemm.chunk_count(k) for k in (0, 1, 512, 513, 1100)] == [0, 1, 1, 2, 3]
    assert c.gemm.chunk_ranges(1100) == [(0, 512), (512, 1024), (1024, 1100)]
    assert c.gemm.chunk_ranges(0) == []
    assert c.logprobs.chunk_ranges(c.logprobs.vocab_chunk + 1)[-1] == (c.logprobs.vocab_chunk,
                                                                         c.logprobs.vocab_chunk + 1)
    assert c.reduce.block_ranges(5) == [(0, 5)]


def test_methods_leave_the_values_and_the_fingerprint_alone():
    import dataclasses

    c = load_contract()
    assert [f.name for f in dataclasses.fields(c.attention)][:5] == ["score_dtype", "scale", "exp", "kv_chunk",
                                                                   "kv_split"]
    assert "split_size" not in c.to_dict()["attention"] and "chunk_count" not in c.to_dict()["gemm"]


# -- capabilities: a contract a backend cannot realise is refused when it is bound -------------------

def test_cuda_refuses_at_bind_a_legal_contract_its_kernels_cannot_realise():
    pytest.importorskip("triton")
    from hal.api import create_backend, resolve_contract
    from hal.backends.cuda import CudaBackend
    from hal.errors import UnsupportedError

    narrow = _variant("attention", kv_chunk=8, kv_split=512)   # legal: a power of two, divides kv_split
    assert narrow.attention.kv_chunk == 8
    for bind in (lambda: create_backend("cuda", narrow), lambda: resolve_contract(CudaBackend, narrow),
                 lambda: CudaBackend(narrow)):
        with pytest.raises(UnsupportedError, match=r"\[attention\]\.kv_chunk = 8 \(realised: a power of two in "
                                                   r"16\.\.128\)"):
            bind()
    with pytest.raises(UnsupportedError, match=r"\[gemm\]\.k_chunk = 16 \(realised: a multiple of 256\)"):
        create_backend("cuda", _variant("gemm", k_chunk=16))
    # the reference backend realises every value the schema accepts: the same contract binds there
    assert create_backend("reference", narrow).contract is narrow


def test_a_subclass_that_overrides_one_capability_keeps_the_rest():
    import torch

    from hal.backends.reference import ReferenceBackend

    class NoFp32Gemm(ReferenceBackend):
        unsupported = (("linear", torch.float32),)

    assert NoFp32Gemm.capabilities.unsupported == (("linear", torch.float32),)
    assert NoFp32Gemm.capabilities.contracts == ReferenceBackend.contracts == ("bf16-dense-v1", "bf16-moe-v1", "bf16-ascend-v1",
                                                                         "bf16-fp8-v1", "bf16-fp8-v2", "bf16-moe-fp8-v1")
    assert ReferenceBackend.capabilities.unsupported == ()


def test_doctor_prints_each_backends_capability_table():
    out = subprocess.run([sys.executable, "-m", "hal.cli", "doctor"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("HAL_")})
    text = out.stdout
    assert "capabilities (a contract outside them is refused when the backend is bound to it):" in text
    cuda = text[text.index("\n  cuda:\n"):]
    assert re.search(r"head dims\s+64, 128", cuda) and re.search(r"\[attention\]\.kv_chunk\s+a power of two", cuda)
    assert re.search(r"\[gemm\]\.k_chunk\s+a multiple of 256", cuda)
    assert re.search(r"\n  reference:\n    contracts\s+bf16-dense-v1", text)
