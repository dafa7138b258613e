"""The HAL ops as torch.library custom ops (``hal.torch_ops``, ``torch.ops.hal.*``).

* Registration: ``torch.library.opcheck`` (schema incl. the caches' mutation, fake implementation,
  autograd registration, AOT dispatch with dynamic shapes) for every op, on ``reference`` and on
  ``cuda`` (Triton interpreter in CI).
* Same bits: each custom op returns exactly the backend method's result (``torch.equal``), at sizes that
  cross the contract's K chunk (512), row block and vocabulary chunk (4096) and a KV chunk (64).
* Compiled: a decoder-block-like chain compiled with ``fullgraph=True`` (a graph break fails) gives the
  eager bits; negative control: the same chain calling the backend's Python directly cannot be compiled
  into one graph (which is why the ops are opaque).
"""

from __future__ import annotations

import pytest
import torch

from conftest import backend_for_tests
from hal import torch_ops
from hal.api import create_backend
from hal.backend import AttentionMetadata
from hal.errors import HalError, UnsupportedError
from hal.kvcache import PagedKVCache, build_metadata, slot_mapping
from hal.rope import cos_sin_cache

HEAD_DIM = 64


@pytest.fixture(scope="module", params=["reference", "cuda"])
def bound(request):
    backend_for_tests(request.param)          # skips cuda unless its kernels are interpreted
    backend = create_backend(request.param, "bf16-moe-v1")   # the dense ops, and the MoE ops too
    key = torch_ops.bind(f"test-{request.param}", lambda: backend)
    yield key, backend
    torch_ops.unbind(key)


def _args(key, k_dim=64, vocab=40, width=32, seq=5):
    """(op name, custom-op arguments) of every op, small shapes."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    page, hkv, hq = 16, 2, 4
    cache = PagedKVCache.allocate(-(-seq // page) + 1, page, hkv, HEAD_DIM, torch.bfloat16)
    pages = list(range(cache.k.shape[0]))[::-1][: -(-seq // page)]
    meta = build_metadata([seq], [seq], [pages])
    slots = slot_mapping(pages, range(seq), page)
    k, v = r(seq, hkv, HEAD_DIM), r(seq, hkv, HEAD_DIM)
    cache.k.zero_(), cache.v.zero_()
    table = cos_sin_cache(HEAD_DIM, 64)
    return {
        "linear": (key, r(3, k_dim), r(7, k_dim), r(7), False),
        "rms_norm": (key, r(3, width), r(width), 1e-6),
        "add_rms_norm": (key, r(3, width), r(3, width), r(width), 1e-6),
        "silu_mul": (key, r(3, 2 * width)),
        "rotary": (key, torch.tensor([0, 5, 63]), r(3, hq, HEAD_DIM), r(3, hkv, HEAD_DIM), table),
        "log_softmax": (key, r(2, vocab, dtype=torch.float32), 0.7),
        "attention": (key, r(seq, hq, HEAD_DIM), k.new_zeros(cache.k.shape).index_put_(
            (slots // page, slots % page), k), v.new_zeros(cache.v.shape).index_put_((slots // page, slots % page), v),
            meta.query_start_loc, meta.seq_lens, meta.block_table, 0.125),
        "write_kv": (key, k, v, cache.k, cache.v, slots),
        "moe_route": (key, r(3, 8, dtype=torch.float32), r(8, dtype=torch.float32) * 0.1, 8, 3, "sigmoid", True,
                      4, 2, 2.5),
        "moe_experts": (key, r(3, k_dim), r(8, 2 * width, k_dim) * k_dim ** -0.5, r(8, k_dim, width) * width ** -0.5,
                        torch.rand(3, 2, generator=g), torch.tensor([[1, 6], [6, 0], [3, 1]], dtype=torch.int32), None),
    }


@pytest.mark.parametrize("op", sorted(torch_ops.OPS))
def test_opcheck(bound, op):
    key, _ = bound
    torch.library.opcheck(torch_ops.OPS[op], _args(key)[op])


def _method_result(backend, op, args):
    _, *a = args
    if op == "linear":
        x, w, b, fp32 = a
        return backend.linear(x, w, b, out_dtype=torch.float32 if fp32 else None)
    if op == "add_rms_norm":
        x, residual, w, eps = a
        return backend.rms_norm(x, w, eps, residual)
    if op == "attention":
        q, kc, vc, qsl, sl, bt, scale = a
        return backend.attention(q, kc, vc, AttentionMetadata(qsl, sl, bt), scale=scale)
    if op == "write_kv":
        k, v, kc, vc, slots = a
        backend.write_kv(k, v, kc, vc, slots)
        return kc, vc
    if op == "moe_route":
        from hal.moe import Routing
        logits, bias, *routing = a
        return backend.moe_route(logits, Routing(*routing), bias)
    return getattr(backend, op)(*a)


def _equal(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("op", sorted(torch_ops.OPS))
def test_custom_op_gives_the_backend_methods_bits(op):
    """Sizes that cross the contract's chunk boundaries (reference: fast on CPU at these sizes)."""
    backend = create_backend("reference", "bf16-moe-v1")
    key = torch_ops.bind("test-bits", lambda: backend)
    args = _args(key, k_dim=1100, vocab=8300, width=4200 if op != "moe_experts" else 600, seq=70)[op]
    if op == "write_kv":
        k, v, kc, vc, slots = args[1:]
        kc2, vc2 = kc.clone(), vc.clone()
        torch.ops.hal.write_kv(key, k, v, kc, vc, slots)
        want = _method_result(backend, op, (key, k, v, kc2, vc2, slots))
        assert _equal((kc, vc), want) and bool(kc.abs().sum() > 0)
        return
    got = getattr(torch.ops.hal, op)(*args)
    assert _equal(tuple(got) if isinstance(got, (tuple, list)) else got, _method_result(backend, op, args))


def _block(op_linear, op_norm, op_silu, x, w_norm, w_up, w_down):
    h = op_norm(x, w_norm)
    return op_linear(op_silu(op_linear(h, w_up)), w_down)


def test_compiled_chain_gives_the_eager_bits_and_has_no_graph_break():
    backend = create_backend("reference")
    key = torch_ops.bind("test-compile", lambda: backend)
    g = torch.Generator().manual_seed(3)
    x, w_norm = torch.randn(5, 96, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    w_up, w_down = torch.randn(128, 96, generator=g).bfloat16(), torch.randn(96, 64, generator=g).bfloat16()

    def with_custom_ops(x, w_norm, w_up, w_down):
        return _block(lambda a, w: torch.ops.hal.linear(key, a, w, None, False),
                      lambda a, w: torch.ops.hal.rms_norm(key, a, w, 1e-6),
                      lambda a: torch.ops.hal.silu_mul(key, a), x, w_norm, w_up, w_down)

    eager = with_custom_ops(x, w_norm, w_up, w_down)
    torch._dynamo.reset()
    compiled = torch.compile(with_custom_ops, fullgraph=True, backend="aot_eager")(x, w_norm, w_up, w_down)
    assert torch.equal(compiled, eager)
    assert torch.equal(eager, _block(backend.linear, lambda a, w: backend.rms_norm(a, w, 1e-6), backend.silu_mul,
                                     x, w_norm, w_up, w_down))

    # Negative control: the backend's own Python (value checks, exact sums on host lists) is not one graph.
    def direct(x, w_norm, w_up, w_down):
        return _block(backend.linear, lambda a, w: backend.rms_norm(a, w, 1e-6), backend.silu_mul,
                      x, w_norm, w_up, w_down)

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # a data-dependent branch of the exact sums
        torch.compile(direct, fullgraph=True, backend="aot_eager")(x, w_norm, w_up, w_down)


def test_an_unbound_key_is_a_clear_error():
    x = torch.randn(2, 8)
    with pytest.raises(HalError, match=r"no backend is bound under 'nobody'"):
        torch.ops.hal.silu_mul("nobody", x)


def test_the_provider_is_asked_on_every_call():
    """An engine's provider may return a different view per call (the binding probe's counting view)."""
    backend, calls = create_backend("reference"), []
    key = torch_ops.bind("test-provider", lambda: calls.append(1) or backend)
    for _ in range(3):
        torch.ops.hal.silu_mul(key, torch.randn(2, 8))
    assert len(calls) == 3


def test_rotary_positions_in_range_flag(bound):
    """The flag's op passes opcheck and gives the same bits; on the CPU (where reading a value is free) the
    range check still runs with it, so a bad position is refused either way."""
    key, _ = bound
    args = _args(key)["rotary"]
    torch.library.opcheck(torch_ops.OPS["rotary"], (*args, True))
    assert _equal(torch.ops.hal.rotary(*args, True), torch.ops.hal.rotary(*args))
    bad = (args[0], torch.tensor([0, 5, 64]), *args[2:])          # the table has 64 rows
    for flag in (False, True):
        with pytest.raises(UnsupportedError, match=r"positions must be in 0\.\.63"):
            torch.ops.hal.rotary(*bad, flag)

