"""Where speculative decoding's draft tokens come from (``RolloutHarness``; issue #24).

A drafter only proposes: the harness verifies every draft against the token plain decoding samples at
that position (seed and position, ``sample_tokens``) and keeps a draft iff it is that token. So a
drafter decides how many tokens a step gains, never which tokens or which logprob bits come out; a bad
drafter costs time, not correctness.

* ``NgramDrafter``: prompt lookup (``propose_ngram``): the continuation of the latest earlier occurrence
  of the sequence's last 1-3 tokens. Free; accepted often on copying and counting tasks.
* ``ModelDrafter``: a small model of the same vocabulary decodes greedily (argmax, ties to the lower
  token id) with its own paged KV cache, kept per request between steps: each call computes only the
  tokens that arrived since the request's last call (its accepted tokens), then one row per further
  draft, all requests of a step in one batch per draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hal.errors import HalError
from hal.kvcache import PageAllocator, build_metadata, pages_needed, slot_mapping
from hal.model.model import DecoderLM, InferenceBatch

#: One request's ask: (request index, its tokens so far, how many drafts at most).
Want = tuple[int, Sequence[int], int]


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 3) -> list[int]:
    """Up to ``k`` draft tokens by prompt lookup: for n = max_n .. 1, the tokens that followed the latest
    earlier occurrence of the last n tokens (none if they never occurred before)."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        suffix = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


class NgramDrafter:
    """Prompt-lookup drafts (no model, no state)."""

    def start(self, num_requests: int, max_tokens: int) -> None:
        pass

    def propose(self, wants: Sequence[Want]) -> list[list[int]]:
        return [propose_ngram(tokens, k) for _, tokens, k in wants]

    def finish(self, index: int) -> None:
        pass


@dataclass
class _DraftState:
    cached: list[int] = field(default_factory=list)     # tokens whose K/V are in the draft model's cache
    pages: list[int] = field(default_factory=list)


class ModelDrafter:
    """Greedy drafts from ``model`` (the draft model: same vocabulary as the target, any size), with a
    paged KV cache of ``page_size``-key pages that keeps each request's computed prefix between steps."""

    def __init__(self, model: DecoderLM, page_size: int = 16):
        self.model = model
        self.page_size = page_size
        self.states: dict[int, _DraftState] = {}
        self.caches = None
        self.forwards = 0                 # draft-model forward calls (one per draft position and step)

    def check_target(self, target: DecoderLM) -> None:
        """Refuse a draft model that cannot draft for ``target``: other vocabulary, device or position range."""
        d, t = self.model.full_config, target.full_config
        if d.vocab_size != t.vocab_size:
            raise HalError(f"draft model: vocabulary {d.vocab_size} differs from the target model's {t.vocab_size}; "
                           f"drafts are token ids of the target's vocabulary")
        if self.model.device != target.device:
            raise HalError(f"draft model on {self.model.device}, target model on {target.device}: put both on "
                           f"one device")
        if d.max_position < t.max_position:
            raise HalError(f"draft model: max_position {d.max_position} is below the target model's "
                           f"{t.max_position}; it could not draft for the target's longest sequences")

    def start(self, num_requests: int, max_tokens: int) -> None:
        """A new ``generate``: a cache for ``num_requests`` sequences of up to ``max_tokens`` tokens each."""
        num_pages = num_requests * pages_needed(max_tokens, self.page_size) + 1
        self.caches = self.model.allocate_kv_cache(num_pages, self.page_size)
        self.allocator = PageAllocator(num_pages, torch.Generator().manual_seed(0))
        self.states = {}

    def finish(self, index: int) -> None:
        """Request ``index`` is done: its pages go back."""
        state = self.states.pop(index, None)
        if state is not None and state.pages:
            self.allocator.give_back(state.pages)

    def propose(self, wants: Sequence[Want]) -> list[list[int]]:
        if self.caches is None:
            raise HalError("ModelDrafter.propose before start(): the harness calls start() at each generate")
        drafts: list[list[int]] = [[] for _ in wants]
        active = [i for i, (_, tokens, k) in enumerate(wants) if k > 0 and tokens]
        # First position: every request's tokens since its cached prefix (at least its last token).
        rows = {}
        for i in active:
            index, tokens, k = wants[i]
            state = self.states.setdefault(index, _DraftState())
            keep = 0
            limit = min(len(state.cached), len(tokens) - 1)
            while keep < limit and state.cached[keep] == tokens[keep]:
                keep += 1
            state.cached = list(tokens[:keep])
            rows[i] = list(tokens[keep:])
        for step in range(max((wants[i][2] for i in active), default=0)):
            if not active:
                break
            next_tokens = self._forward([(wants[i][0], rows[i]) for i in active])
            still = []
            for i, token in zip(active, next_tokens):
                drafts[i].append(token)
                if len(drafts[i]) < wants[i][2]:
                    rows[i] = [token]
                    still.append(i)
            active = still
        return drafts

    def _forward(self, chunks: list[tuple[int, list[int]]]) -> list[int]:
        """One batched forward: each request's new tokens appended after its cached ones; the argmax of
        each request's last row (ties to the lower token id)."""
        device = self.model.device
        page = self.page_size
        ids, positions, slots, q_lens, seq_lens, page_lists, last_rows = [], [], [], [], [], [], []
        rows = 0
        for index, new in chunks:
            state = self.states[index]
            lo, hi = len(state.cached), len(state.cached) + len(new)
            need = pages_needed(hi, page) - len(state.pages)
            if need > 0:
                state.pages += self.allocator.take(need)
            ids.extend(new)
            positions.extend(range(lo, hi))
            slots.append(slot_mapping(state.pages, range(lo, hi), page, device))
            q_lens.append(len(new))
            seq_lens.append(hi)
            page_lists.append(list(state.pages))
            rows += len(new)
            last_rows.append(rows - 1)
            state.cached += new
        batch = InferenceBatch(torch.tensor(ids, dtype=torch.long, device=device),
                               torch.tensor(positions, dtype=torch.long, device=device),
                               torch.cat(slots), build_metadata(q_lens, seq_lens, page_lists, device),
                               torch.tensor(last_rows, dtype=torch.long, device=device))
        self.forwards += 1
        logits = self.model.forward_infer(batch, self.caches)
        return logits.argmax(-1).tolist()     # the first maximal index: ties to the lower token id
