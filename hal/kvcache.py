"""A paged KV cache: page allocation, slot mapping and attention metadata.

Layout (the same as vLLM's and FlashAttention's paged layout): ``k_cache`` and ``v_cache`` are
(num_pages, page_size, num_kv_heads, head_dim) tensors; key j of a sequence lives in page
``block_table[j // page_size]`` at row ``j % page_size``, i.e. at flat slot
``page * page_size + row``.

Memory order is a separate, free choice (it moves no arithmetic, so it never changes a bit):
``NHD`` stores each page as (page_size, num_kv_heads, head_dim), one token's heads side by side,
as vLLM allocates; ``HND`` stores it as (num_kv_heads, page_size, head_dim), so one head's keys of a
page are contiguous, and hands out the same (num_pages, page_size, num_kv_heads, head_dim) view
with other strides. Every op indexes the cache through its strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.backend import AttentionMetadata
from hal.errors import HalError


@dataclass
class PagedKVCache:
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", layout: str = "NHD") -> "PagedKVCache":
        """NaN-filled caches (a kernel reading a slot nobody wrote shows up in every test) in the
        memory order ``layout`` (``NHD`` or ``HND``, module docstring)."""
        return cls(cache_tensor(num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout, float("nan")),
                   cache_tensor(num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout, float("nan")))

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]


LAYOUTS = ("NHD", "HND")


def cache_tensor(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", layout: str = "NHD", fill: float = 0.0) -> torch.Tensor:
    """One (num_pages, page_size, num_kv_heads, head_dim) cache tensor stored in ``layout`` order."""
    if layout == "NHD":
        return torch.full((num_pages, page_size, num_kv_heads, head_dim), fill, dtype=dtype, device=device)
    if layout == "HND":
        stored = torch.full((num_pages, num_kv_heads, page_size, head_dim), fill, dtype=dtype, device=device)
        return stored.permute(0, 2, 1, 3)
    raise HalError(f"unknown KV-cache layout {layout!r}; expected one of {LAYOUTS}")


class PageAllocator:
    """Hands out page ids; ``scramble`` hands them out in a seeded random order (as a busy engine does)."""

    def __init__(self, num_pages: int, generator: torch.Generator | None = None):
        order = torch.randperm(num_pages, generator=generator) if generator is not None else torch.arange(num_pages)
        self._free = order.tolist()

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise HalError(f"KV cache out of pages: need {count}, {len(self._free)} free")
        pages, self._free = self._free[:count], self._free[count:]
        return pages

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def slot_mapping(pages: list[int], positions: range | list[int], page_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat cache slots of ``positions`` of one sequence whose pages are ``pages``."""
    return torch.tensor([pages[p // page_size] * page_size + p % page_size for p in positions],
                        dtype=torch.long, device=device)


def build_metadata(q_lens: list[int], seq_lens: list[int], page_lists: list[list[int]],
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """Attention metadata for sequences whose last ``q_lens[b]`` of ``seq_lens[b]`` tokens are queries."""
    if not (len(q_lens) == len(seq_lens) == len(page_lists)):
        raise HalError("build_metadata: q_lens, seq_lens and page_lists must have one entry per sequence")
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    width = max((len(p) for p in page_lists), default=0) or 1
    table = [p + [0] * (width - len(p)) for p in page_lists]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
    )
