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
    with pytest.raises(UnknownContractError, match="shipped contracts: bf16-dense-v1"):
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
