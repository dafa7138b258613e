"""hal.digest: the weight-sync fingerprint. Three implementations of one integer function must agree
(plain Python ints, the torch one, the Triton kernel under the interpreter), for sizes across the
kernel's block and the torch implementation's chunk; negative controls show it sees every kind of
difference a broken copy makes (a flipped bit, swapped words, a shift, a truncation)."""

from __future__ import annotations

import os

import pytest
import torch

from hal import digest

M32 = 0xFFFFFFFF


def _fmix32_py(x: int) -> int:
    x ^= x >> 16
    x = (x * digest.FMIX1) & M32
    x ^= x >> 13
    x = (x * digest.FMIX2) & M32
    return x ^ (x >> 16)


def _fingerprint_py(t: torch.Tensor) -> tuple[int, int, int]:
    """The module docstring's definition, word by word in Python integers (small tensors only)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
    nbytes = len(raw)
    raw += [0] * (-nbytes % 4)
    lanes = []
    for seed in digest.SEEDS:
        total = 0
        for i in range(len(raw) // 4):
            w = int.from_bytes(bytes(raw[4 * i:4 * i + 4]), "little")
            key = _fmix32_py(((i & M32) * digest.POS_LO + (i >> 32) * digest.POS_HI + seed) & M32)
            total += _fmix32_py(w ^ key)
        lanes.append(total % (1 << 64))
    return (nbytes, *lanes)


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    yield torch.randn(7, 5, generator=g).to(torch.bfloat16)              # 70 bytes: a padded last word
    yield torch.randn(3, generator=g)                                     # fp32
    yield torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8)   # 13 bytes
    yield torch.randn(300, generator=g).to(torch.float8_e4m3fn)
    yield torch.randn(64, 130, generator=g).to(torch.bfloat16)[:, 1:129]  # a non-contiguous view
    yield torch.empty(0, dtype=torch.bfloat16)


def test_torch_implementation_is_the_definition():
    for t in _tensors(0):
        assert digest.fingerprint_torch(t) == _fingerprint_py(t)


def test_torch_chunking_does_not_change_the_value(monkeypatch):
    t = torch.randn(1000).to(torch.bfloat16)
    whole = digest.fingerprint_torch(t)
    for chunk in (1, 7, 64, 499):
        monkeypatch.setattr(digest, "TORCH_CHUNK", chunk)
        assert digest.fingerprint_torch(t) == whole


def test_position_keys_use_the_high_word():
    """Words past 2**32 positions are keyed by both halves of the position (checked on the key alone:
    no tensor that large in CI)."""
    def key(i, seed):
        pos = torch.tensor([i], dtype=torch.int64)
        return int(digest._fmix32((digest._mul32(pos & M32, digest.POS_LO)
                                   + digest._mul32(pos >> 32, digest.POS_HI) + seed) & M32))
    for i in (0, 5, (1 << 32) + 5, (3 << 32) + 5, (1 << 32) - 1):
        expected = _fmix32_py(((i & M32) * digest.POS_LO + (i >> 32) * digest.POS_HI + digest.SEEDS[0]) & M32)
        assert key(i, digest.SEEDS[0]) == expected
    assert key(5, digest.SEEDS[0]) != key((1 << 32) + 5, digest.SEEDS[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter test (a GPU is present)")
@pytest.mark.parametrize("words", [1, 63, 64, 65, 127, 128, 129, 1000])
def test_kernel_equals_torch(words):
    """The kernel's blocks (64 words x 2 iterations per program under the interpreter) and grids do
    not change the value: equal to the torch implementation at sizes around each boundary."""
    from hal.kernels.digest import lane_sums

    g = torch.Generator().manual_seed(words)
    w = torch.randint(-2**31, 2**31, (words,), generator=g, dtype=torch.int32)
    assert torch.equal(lane_sums(w), digest._lane_sums_torch(w))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter test (a GPU is present)")
def test_kernel_on_extreme_words():
    from hal.kernels.digest import lane_sums

    for value in (0, -1, 2**31 - 1, -2**31):
        w = torch.full((130,), value, dtype=torch.int32)
        assert torch.equal(lane_sums(w), digest._lane_sums_torch(w))


def test_equal_bytes_equal_digest_and_dtype_shape_enter_it():
    t = torch.randn(4, 6).to(torch.bfloat16)
    assert digest.tensor_digest(t) == digest.tensor_digest(t.clone())
    assert digest.fingerprint(t) == digest.fingerprint(t.view(torch.int16))        # the same bytes
    assert digest.tensor_digest(t) != digest.tensor_digest(t.view(torch.int16))    # another dtype
    assert digest.tensor_digest(t) != digest.tensor_digest(t.reshape(6, 4))        # another shape


def test_negative_controls_every_broken_copy_is_seen():
    g = torch.Generator().manual_seed(3)
    t = torch.randn(257, generator=g).to(torch.bfloat16)
    base = digest.fingerprint(t)
    raw = t.view(torch.int16)
    # one flipped bit, at every bit of a few positions: both lanes change
    for pos in (0, 1, 128, 256):
        for bit in range(16):
            flipped = raw.clone()
            flipped[pos] ^= (1 << bit) if bit < 15 else -(1 << 15)
            fp = digest.fingerprint(flipped)
            assert fp[1] != base[1] and fp[2] != base[2], (pos, bit)
    # two different words swapped (an order-blind sum of words would miss it)
    w = t.view(torch.int16).clone()
    assert w[10] != w[20]
    w[10], w[20] = w[20].clone(), w[10].clone()
    assert digest.fingerprint(w)[1:] != base[1:]
    # shifted by one element, and truncated by one trailing zero byte
    shifted = torch.cat([raw[-1:], raw[:-1]])
    assert digest.fingerprint(shifted)[1:] != base[1:]
    padded = torch.cat([t.view(torch.uint8), torch.zeros(1, dtype=torch.uint8)])
    assert digest.fingerprint(padded)[0] != digest.fingerprint(t)[0]
    # and a control on the control: an order-blind sum of the words does miss the swap
    assert int(w.to(torch.int64).sum()) == int(raw.to(torch.int64).sum())


def test_batched_digests_equal_one_at_a_time():
    """tensor_digests (one transfer for all) gives each tensor's own digest, in order."""
    ts = list(_tensors(5))
    assert digest.tensor_digests(ts) == [digest.tensor_digest(t) for t in ts]
    assert digest.fingerprints(ts) == [_fingerprint_py(t) for t in ts]
    assert len(set(digest.tensor_digests(ts))) == len(ts)
