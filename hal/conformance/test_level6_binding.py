"""Level 6: contract binding. The backend reports the fingerprint of the contract it realises, a
mismatch is caught, and a backend bound to a variant contract either refuses it or follows it
(its bits change with the contract's numbers: it reads them instead of hard-coding them)."""

import dataclasses

import pytest
import torch

from hal.api import require_fingerprint
from hal.conformance.checks import AttentionCase, random_tensor
from hal.conformance.kit import skip_unless_in_contract
from hal.contract import load_contract
from hal.errors import ContractMismatchError, UnsupportedError
from hal.kvcache import PagedKVCache, build_metadata, pages_needed, slot_mapping


@pytest.mark.hal(level=6, op="contract")
def test_backend_reports_the_contract_fingerprint(hal_backend):
    if hal_backend.contract is None:
        pytest.fail(f"backend {hal_backend.name!r} realises no contract (fingerprint None): it is a baseline")
    loaded = load_contract(hal_backend.contract.source if hal_backend.contract.source.endswith(".toml")
                           and not hal_backend.contract.source.startswith("contracts/")
                           else hal_backend.contract.name)
    assert hal_backend.fingerprint == loaded.fingerprint
    require_fingerprint(hal_backend, loaded.fingerprint)


# Every integer of the contract that decides bits, and how to run its op on an input that crosses both
# the contract's boundary and the variant's: (section, field) -> function(backend, value) -> output.
def _gemm(backend, k_chunk):
    g = torch.Generator().manual_seed(0)
    k = 2 * k_chunk + 7
    x = random_tensor((8, k), _dtype(backend), g, spread=8, device=backend.device)
    w = random_tensor((16, k), _dtype(backend), g, spread=8, device=backend.device)
    return backend.linear(x, w, out_dtype=torch.float32)


def _attention(backend, keys):
    """Decode of the last token of a ``keys``-long context (the context crosses chunks and splits)."""
    case = AttentionCase(keys, 2, 1, 64, _dtype(backend), 0)
    q, k, v = case.tensors(backend.device)
    page = 16
    cache = PagedKVCache.allocate(pages_needed(keys, page), page, 1, 64, case.dtype, backend.device)
    pages = list(range(pages_needed(keys, page)))
    backend.write_kv(k, v, cache.k, cache.v, slot_mapping(pages, range(keys), page, backend.device))
    return backend.attention(q[-1:], cache.k, cache.v, build_metadata([1], [keys], [pages], backend.device),
                             scale=0.125)


def _rms_norm(backend, block):
    g = torch.Generator().manual_seed(0)
    x = random_tensor((8, 2 * block + 5), _dtype(backend), g, spread=8, device=backend.device)
    return backend.rms_norm(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 1e-6)


def _logprobs(backend, chunk):
    # One logit at 0 and the rest near -12: the total of exp is 1 + a few percent, so a change of the
    # chunked sum by one ulp moves log(total), which is the log-probability of the largest logit.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 2 * chunk + 5, generator=g) - 12.0
    logits[:, 3] = 0.0
    return backend.log_softmax(logits.to(backend.device))


def _sum(backend, block):
    g = torch.Generator().manual_seed(0)
    return backend.sum(random_tensor((8, 2 * block + 5), _dtype(backend), g, spread=8, device=backend.device))


def _dtype(backend):
    return torch.float32 if torch.float32 in backend.dtypes else backend.dtypes[0]


BIT_DECIDING = {("gemm", "k_chunk"): _gemm, ("attention", "kv_chunk"): lambda b, c: _attention(b, 2 * c + 7),
                ("attention", "kv_split"): lambda b, s: _attention(b, 2 * s + 7), ("rms_norm", "row_block"): _rms_norm,
                ("logprobs", "vocab_chunk"): _logprobs, ("reduce", "row_block"): _sum}


def _moe_experts(backend, k_chunk):
    """A layer of 4 experts, top-2, whose gate/up and down GEMMs both cross ``k_chunk`` (hidden and intermediate
    2 k_chunk + 7): [moe] runs every expert GEMM under [gemm]'s K-chunk rule."""
    from hal.moe import Routing

    g = torch.Generator().manual_seed(0)
    dim, experts, dtype, dev = 2 * k_chunk + 7, 4, _dtype(backend), backend.device
    x = random_tensor((4, dim), dtype, g, spread=8, device=dev)
    w13 = random_tensor((experts, 2 * dim, dim), dtype, g, scale=dim ** -0.5, spread=4, device=dev)
    w2 = random_tensor((experts, dim, dim), dtype, g, scale=dim ** -0.5, spread=4, device=dev)
    weights, ids = backend.moe_route(random_tensor((4, experts), torch.float32, g, device=dev), Routing(experts, 2))
    return backend.moe_experts(x, w13, w2, weights, ids)


@pytest.mark.hal(level=6, op="contract")
@pytest.mark.parametrize("number", [f"{s}.{f}" for s, f in BIT_DECIDING])
def test_a_variant_contract_is_refused_or_followed(hal_backend, number):
    """Halve one bit-deciding integer: the backend bound to the variant refuses it, or gives other bits on an
    input that crosses the boundary (it reads the number from its contract instead of hard-coding it)."""
    _refused_or_followed(hal_backend, number, BIT_DECIDING[tuple(number.split("."))])


@pytest.mark.hal(level=6, op="moe_experts")
def test_moe_expert_gemms_follow_the_contracts_k_chunk(hal_backend):
    """The same for the expert GEMMs of an MoE layer: halving [gemm].k_chunk is refused or changes their bits
    (an expert GEMM that hard-coded its chunk, or ignored it, would keep them)."""
    skip_unless_in_contract(hal_backend, "moe_experts")
    _refused_or_followed(hal_backend, "gemm.k_chunk", _moe_experts)


def _refused_or_followed(hal_backend, number: str, run) -> None:
    if hal_backend.contract is None:
        pytest.fail(f"backend {hal_backend.name!r} realises no contract")
    base = hal_backend.contract
    section, name = number.split(".")
    value = getattr(getattr(base, section), name)
    if value == 0:
        pytest.fail(f"{number} is 0 in {base.name}: nothing to vary (the kit has no check for this contract)")
    variant = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{name: value // 2})})
    assert variant.fingerprint != base.fingerprint
    with pytest.raises(ContractMismatchError):
        require_fingerprint(hal_backend, variant.fingerprint)
    try:
        other = type(hal_backend)(variant, hal_backend.device)
    except (ContractMismatchError, UnsupportedError):
        return  # refused: fine
    assert other.fingerprint == variant.fingerprint
    try:
        same = torch.equal(run(hal_backend, value), run(other, value))
    except UnsupportedError:
        return  # the variant is accepted at construction but refused per call: fine
    if same:
        pytest.fail(f"{number} halved ({value} -> {value // 2}) but the bits did not change on an input crossing "
                    f"both boundaries: backend {hal_backend.name!r} ignores its contract's {number}", pytrace=False)
