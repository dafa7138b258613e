"""Per-op capture of chosen tokens, for finding where two runs stop agreeing (``hal diff``).

The model calls ``trace.record(op, output)`` after every numerically relevant op when a trace is
passed to its forward. The caller says, per forward call, which batch rows belong to the traced
sequence and at which positions (``watch``); the trace keeps a CPU copy of those rows, keyed by
(op name, position), with the shape of the call it came from (its batch composition). Two traces of
runs that should agree are compared by ``hal.diff.first_divergence``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass
class TraceEntry:
    """One op output for one token: its row, and where the row sat in the op's call."""

    value: torch.Tensor     # (...,) this token's row of the op output, a CPU copy in the op's dtype
    call_shape: tuple       # shape of the whole op output in that call
    row: int                # this token's row in the call
    call: str               # which forward call ("rollout step 7", "train batch 0", ...)


class OpTrace:
    """Op outputs of the traced tokens of one run: ``entries[(op, position)]``."""

    def __init__(self, label: str = ""):
        self.label = label
        self.entries: dict[tuple[str, int], TraceEntry] = {}
        self.op_order: list[str] = []          # op names in the order the forward first ran them
        self.tokens: dict[int, int] = {}       # position -> input token id
        self._rows: dict[int, int] | None = None
        self._call = ""

    @contextlib.contextmanager
    def watch(self, rows: Sequence[int], positions: Sequence[int], call: str = "") -> Iterator["OpTrace"]:
        """Within the block, batch row ``rows[i]`` of every recorded op is the token at ``positions[i]``."""
        if len(rows) != len(positions):
            raise ValueError(f"watch: {len(rows)} rows but {len(positions)} positions")
        previous = (self._rows, self._call)
        self._rows, self._call = dict(zip((int(r) for r in rows), (int(p) for p in positions))), call
        try:
            yield self
        finally:
            self._rows, self._call = previous

    @property
    def watching(self) -> bool:
        return bool(self._rows)

    def record_tokens(self, token_ids: torch.Tensor) -> None:
        if not self._rows:
            return
        for row, position in self._rows.items():
            self.tokens.setdefault(position, int(token_ids[row]))

    def record(self, op: str, output: torch.Tensor, row_map: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep the watched rows of ``output`` (first dim = rows). ``row_map[i]`` is the batch row of
        output row i when the op ran on a subset of the batch (the logits rows); the first capture of
        an (op, position) is kept (a recomputation after preemption does not overwrite it)."""
        if not self._rows:
            return
        if op not in self.op_order:
            self.op_order.append(op)
        if row_map is None:
            where = {row: row for row in self._rows}
        else:
            rows = row_map.tolist() if isinstance(row_map, torch.Tensor) else list(row_map)
            where = {int(batch_row): i for i, batch_row in enumerate(rows) if int(batch_row) in self._rows}
        for batch_row, i in where.items():
            key = (op, self._rows[batch_row])
            if key not in self.entries:
                self.entries[key] = TraceEntry(output[i].detach().to("cpu", copy=True), tuple(output.shape), i,
                                               self._call)

    def positions(self, op: str | None = None) -> list[int]:
        return sorted({p for (o, p) in self.entries if op is None or o == op})
