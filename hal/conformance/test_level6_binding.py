"""Level 6: contract binding. The backend reports the fingerprint of the contract it realises, a
mismatch is caught, and a backend bound to a variant contract either refuses it or follows it
(its bits change with the contract's numbers: it reads them instead of hard-coding them)."""

import dataclasses

import pytest
import torch

from hal.api import require_fingerprint
from hal.conformance.checks import random_tensor
from hal.contract import load_contract
from hal.errors import ContractMismatchError, UnsupportedError


@pytest.mark.hal(level=6, op="contract")
def test_backend_reports_the_contract_fingerprint(hal_backend):
    if hal_backend.contract is None:
        pytest.fail(f"backend {hal_backend.name!r} realises no contract (fingerprint None): it is a baseline")
    loaded = load_contract(hal_backend.contract.source if hal_backend.contract.source.endswith(".toml")
                           and not hal_backend.contract.source.startswith("contracts/")
                           else hal_backend.contract.name)
    assert hal_backend.fingerprint == loaded.fingerprint
    require_fingerprint(hal_backend, loaded.fingerprint)


@pytest.mark.hal(level=6, op="contract")
def test_a_variant_contract_is_refused_or_followed(hal_backend):
    if hal_backend.contract is None:
        pytest.fail(f"backend {hal_backend.name!r} realises no contract")
    base = hal_backend.contract
    variant = dataclasses.replace(base, gemm=dataclasses.replace(base.gemm, k_chunk=base.gemm.k_chunk * 2))
    assert variant.fingerprint != base.fingerprint
    with pytest.raises(ContractMismatchError):
        require_fingerprint(hal_backend, variant.fingerprint)
    try:
        other = type(hal_backend)(variant, hal_backend.device)
    except (ContractMismatchError, UnsupportedError):
        return  # refused: fine
    assert other.fingerprint == variant.fingerprint
    g = torch.Generator().manual_seed(0)
    k = 4 * base.gemm.k_chunk
    dtype = torch.float32 if torch.float32 in hal_backend.dtypes else hal_backend.dtypes[0]
    x = random_tensor((8, k), dtype, g, spread=8, device=hal_backend.device)
    w = random_tensor((64, k), dtype, g, spread=8, device=hal_backend.device)
    try:
        same = torch.equal(hal_backend.linear(x, w, out_dtype=torch.float32),
                           other.linear(x, w, out_dtype=torch.float32))
    except UnsupportedError:
        return  # the variant is accepted at construction but refused per call: fine
    assert not same, "k_chunk changed but the GEMM bits did not: the backend ignores its contract"
