"""Tensor parallelism with the same bits at every degree: the contract's [parallel] realised on
``torch.distributed`` (gloo on the CPU, NCCL on GPUs; nothing here names a transport).

Rules (``Contract.parallel``; ``docs/parallel.md``):
  * a split reduced dim (a row-parallel linear's K, the vocabulary) is cut into equal contiguous
    shards in rank order, each a whole number of contract chunks, else ``UnsupportedError``;
  * row-parallel linear: every rank computes its K chunks' fp32 sums
    (``Backend.linear_chunk_partials``), the partials are all-gathered (exact copies) and every rank
    adds all of them in ascending global chunk order from +0, adds the bias, rounds once
    (``Backend.combine_chunks``): the one-device [gemm] rule, whatever the degree;
  * vocab-parallel logprobs: chunk maxes all-gathered, M = their max (exact); chunk sums of
    exp(x - M) all-gathered and added in ascending chunk order (``Backend.logprob_*``): the one-device
    [logprobs] rule;
  * vocab-parallel embedding and full-vocab logits: exact copies from the owning rank.
No value that decides bits goes through an all-reduce: its tree depends on the degree and the
transport (``tests/test_parallel.py`` shows a plain all-reduce changing bits with the degree).

Every rank must make the same calls in the same order (SPMD), as with any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hal.backend import Backend
from hal.contract import parse_contract
from hal.errors import UnsupportedError

#: The [parallel] section with the rules this module realises. No shipped contract carries it yet (a
#: version of bf16-dense-v1 with it, or a new contract, is still to decide: docs/parallel.md);
#: ``contract_with_parallel`` appends it to a shipped contract's text.
PARALLEL_SECTION = """
[parallel]
shards = "whole_chunks"
row_parallel = "gather_chunk_partials_ascending"
vocab_parallel = "gather_chunk_max_then_chunk_sums"
embedding = "owner_row_copy"
column_parallel = "local"
"""


def contract_with_parallel(name: str = "bf16-dense-v1", *, source: str | None = None):
    """The shipped contract ``name`` with ``PARALLEL_SECTION`` appended (its own fingerprint)."""
    text = resources.files("hal.contracts").joinpath(f"{name}.toml").read_text()
    return parse_contract(text + PARALLEL_SECTION, source=source or f"{name} + [parallel]")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank ``rank`` of ``world_size`` in ``group``
    (None: the default process group)."""

    rank: int
    world_size: int
    group: Any = None

    @classmethod
    def current(cls, group: Any = None) -> "TensorParallel":
        """The layout of the initialised process group (``dist.init_process_group`` first)."""
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedError("tensor parallelism needs an initialised torch.distributed process group "
                                   "(torch.distributed.init_process_group(backend='gloo' or 'nccl', ...))")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def shard(self, total: int, chunk: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's shard of a reduced dim of ``total``, cut into ``world_size`` equal
        contiguous shards of whole ``chunk``s ([parallel].shards = "whole_chunks"); refuses any other cut."""
        if total % self.world_size or (total // self.world_size) % chunk:
            raise UnsupportedError(
                f"{what}: {total} split over {self.world_size} ranks is not {self.world_size} equal shards of whole "
                f"chunks of {chunk} ([parallel].shards = 'whole_chunks'): a shard that cuts a chunk would change "
                f"that chunk's sum and so the bits. Use a degree for which {total} / degree is a multiple of "
                f"{chunk}, or a contract with a chunk that divides the shard")
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (one shape on all ranks), in rank order: exact copies of the bits (bf16 and
        fp16 travel as their bytes, uint8, which every transport carries: gloo has no bf16)."""
        t = t.contiguous()
        if t.numel() == 0:     # every rank has the same (empty) shape: nothing to send
            return [t.clone() for _ in range(self.world_size)]
        wire = t.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else t
        out = [torch.empty_like(wire) for _ in range(self.world_size)]
        dist.all_gather(out, wire, group=self.group)
        return [o.view(t.dtype) for o in out]


def check_contract(backend: Backend, op: str):
    """The contract's [parallel], or a refusal that says why there is none."""
    contract = backend.contract
    if contract is None or contract.parallel is None:
        bound = "no contract" if contract is None else f"contract {contract}"
        raise UnsupportedError(f"{op}: {bound} has no [parallel] section, so it does not say how ranks combine a "
                               f"reduction and a sharded model's bits are not decided; use a contract with one "
                               f"(see docs/parallel.md)")
    return contract.parallel


# ---------------------------------------------------------------------------------------------
# Row-parallel linear ([parallel].row_parallel = "gather_chunk_partials_ascending").
# ---------------------------------------------------------------------------------------------

def row_parallel_linear(backend: Backend, tp: TensorParallel, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x_full @ w_full.T (+ bias)`` from this rank's K shard: x (..., Ks), weight (N, Ks) the rank's
    columns of the full (N, Ks * world_size) weight, bias (N,) the full bias (added once, in the
    combine). Returns (..., N) in ``out_dtype`` (default x.dtype), the same on every rank and bitwise
    ``backend.linear(x_full, w_full, bias)`` of one device."""
    check_contract(backend, "row_parallel_linear")
    k_local = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k_local:
        raise UnsupportedError(f"row_parallel_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                               f"match (weight must be the rank's (N, Ks) columns, Ks = x.shape[-1])")
    start, _ = tp.shard(k_local * tp.world_size, backend.contract.gemm.k_chunk, "row_parallel_linear K")
    if tp.world_size == 1:
        # One rank holds every chunk: the ordered combine of its own partials is the one-device [gemm]
        # rule, which ``linear`` realises directly, without the (C, M, N) fp32 partials (2.2-2.6x the
        # GEMM's time at prefill sizes on the H200: bench/results/h200-2026-12-02-session8).
        return backend.linear(x, weight, bias, out_dtype=out_dtype)
    partials = backend.linear_chunk_partials(x, weight, start)                 # (C_local, M, N) fp32
    ordered = torch.cat(tp.all_gather(partials))                               # rank order = chunk order
    out = backend.combine_chunks(ordered, bias, out_dtype=out_dtype or x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# Vocab parallelism ([parallel].vocab_parallel, [parallel].embedding).
# ---------------------------------------------------------------------------------------------

def _owned(tp: TensorParallel, token_ids: torch.Tensor, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner rank, local index clamped into this shard) of every token id."""
    ids = token_ids.long()
    local = ids - tp.rank * vocab_local
    return ids // vocab_local, local.clamp(0, vocab_local - 1)


def _pick(gathered: list[torch.Tensor], owner: torch.Tensor) -> torch.Tensor:
    """Row i of the owner's tensor, for every i (an exact copy)."""
    stacked = torch.stack(gathered)                                           # (ranks, M, ...)
    index = owner.view(1, -1, *([1] * (stacked.dim() - 2))).expand(1, *stacked.shape[1:])
    return stacked.gather(0, index.to(stacked.device)).squeeze(0)


def vocab_parallel_token_logprobs(backend: Backend, tp: TensorParallel, logits: torch.Tensor,
                                  token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 (M,) logprob of ``token_ids`` (M,) (full-vocabulary ids) from this rank's vocab shard of
    the logits (M, Vs): the same on every rank and bitwise ``backend.token_logprobs`` of the full
    (M, Vs * world_size) logits on one device."""
    check_contract(backend, "vocab_parallel_token_logprobs")
    vocab_local = logits.shape[-1]
    start, _ = tp.shard(vocab_local * tp.world_size, backend.contract.logprobs.vocab_chunk,
                        "vocab_parallel_token_logprobs vocabulary")
    if tp.world_size == 1:     # the whole vocabulary on one rank: the pieces' combine is token_logprobs itself
        return backend.token_logprobs(logits, token_ids.to(logits.device), temperature)
    chunk_max = torch.cat(tp.all_gather(backend.logprob_chunk_max(logits, temperature, start)), dim=-1)
    row_max = chunk_max.amax(-1)                                              # exact in any order
    chunk_sums = torch.cat(tp.all_gather(backend.logprob_chunk_sums(logits, row_max, temperature, start)), dim=-1)
    owner, local = _owned(tp, token_ids, vocab_local)
    mine = logits.float().gather(-1, local.view(-1, 1).to(logits.device)).squeeze(-1)
    token_logits = _pick(tp.all_gather(mine), owner)
    return backend.logprob_combine(token_logits, row_max, chunk_sums, temperature)


def vocab_parallel_embedding(tp: TensorParallel, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of the full (Vs * world_size, H) embedding for ``token_ids`` (T,), from this rank's shard
    (Vs, H): each row looked up by its owner and copied to every rank (exact)."""
    owner, local = _owned(tp, token_ids, weight.shape[0])
    return _pick(tp.all_gather(F.embedding(local.to(weight.device), weight)), owner)


def gather_vocab(tp: TensorParallel, logits: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary logits (M, Vs * world_size) from every rank's shard (M, Vs): a copy."""
    return torch.cat(tp.all_gather(logits), dim=-1)


__all__ = ["TensorParallel", "check_contract", "gather_vocab", "row_parallel_linear",
           "vocab_parallel_embedding", "vocab_parallel_token_logprobs"]
