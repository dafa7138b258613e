"""An in-process rollout harness: continuous batching over a paged KV cache, deterministic by seed.

It exists for tests, benchmarks and machines without vLLM; it is not a serving engine. Every step
it (in an order drawn from ``HarnessConfig.seed``) may preempt a running request, admits waiting
requests, cuts each request's remaining prefill into a random chunk within a token budget, lays
the chosen queries out as one packed batch (prefill chunks and decodes mixed, pages handed out
in a scrambled order) and runs ``DecoderLM.forward_infer``. Sequences whose prefill or decode
reaches their last token sample the next one with ``sample_tokens`` (noise from the request's seed
and the position only) and report its fp32 logprob from ``model.next_token_logprobs`` (``backend.token_logprobs``) of the fp32
logits. So with a batch-invariant, phase-consistent backend every token and logprob is the same
whatever the schedule, and equal to the trainer's recomputation (``recompute_logprobs``).

Preemption drops the request's pages; when readmitted it prefills its prompt plus the tokens it
generated so far, and continues. Logprobs already reported are kept, never recomputed.

Speculative decoding (``HarnessConfig.speculative_tokens = k``): a decoding request gets up to k draft
tokens, by prompt lookup (``propose_ngram``: the continuation of the latest earlier occurrence of its last
1-3 tokens) or, given ``RolloutHarness(..., draft_model=small_model)``, by a small model's greedy decoding
(``hal.rollout.drafters``), and is run as one chunk of 1 + len(drafts) queries, its last token and the drafts. The
target token at each of those positions is sampled exactly as a plain decode samples it (seed and
position, ``sample_tokens``); draft j is accepted iff it equals the target token before it, and the
targets up to the first rejection are the new tokens. So the output tokens are the ones plain decoding
gives, and their logprobs the same bits as long as the backend's attention and GEMMs do not depend on
whether a query comes one per step or in a chunk (the contract's phase consistency). The rejected
drafts' K/V is left in the cache past the sequence's length and written over later.

Prefix caching (``HarnessConfig.prefix_caching``): a full page whose K/V are computed is kept under the
tokens from position 0 through its last (``_PagePool``); a request admitted with no pages takes the
longest run of kept pages its tokens begin with (shared, held by every sequence using them) and
computes from there, at least its last token. Kept pages nobody holds are given back, least recently
used first, when pages run out. A kept page holds the bits a recomputation would give as long as the
backend's K/V do not depend on the batch or the chunking (the contract's batch invariance).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hal.errors import HalError
from hal.kvcache import PageAllocator, build_metadata, pages_needed, slot_mapping
from hal.model.model import DecoderLM, InferenceBatch
from hal.model.trace import OpTrace
from hal.rollout.drafters import ModelDrafter, NgramDrafter, propose_ngram  # noqa: F401  (propose_ngram: public)
from hal.rollout.sampler import sample_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """One prompt to continue. ``temperature == 0`` is greedy (its logprobs are at temperature 1)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    seed: int = 0
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Completion:
    """What the harness returns per request, in the order of the input list."""

    request: Request
    tokens: list[int]
    logprobs: torch.Tensor          # (len(tokens),) fp32, on the CPU
    finish_reason: str              # "length" or "stop"
    preemptions: int = 0
    prompt_logprobs: torch.Tensor | None = None   # (len(prompt) - 1,) fp32, when an engine was asked for them
    cached_prompt_tokens: int = 0   # prompt tokens an engine read from its prefix cache instead of computing

    @property
    def prompt(self) -> list[int]:
        return list(self.request.prompt)

    @property
    def sequence(self) -> list[int]:
        return list(self.request.prompt) + self.tokens


@dataclass(frozen=True)
class HarnessConfig:
    """Cache and schedule. ``seed`` drives every scheduling choice (admission, preemption, chunk
    sizes, batch order, page order); it never touches the sampler, which is seeded per request."""

    page_size: int = 16
    num_pages: int | None = None        # None: every request's full length fits at once
    max_num_seqs: int = 8
    max_batch_tokens: int = 64
    max_chunk: int | None = None        # largest prefill chunk drawn (default: max_batch_tokens)
    preempt_prob: float = 0.0           # chance per step of preempting a random running request
    speculative_tokens: int = 0         # draft tokens per decode (prompt lookup); 0: plain decoding
    prefix_caching: bool = False        # reuse computed full pages of a shared token prefix
    seed: int = 0

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "max_batch_tokens"):
            if getattr(self, name) <= 0:
                raise HalError(f"HarnessConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.preempt_prob < 1.0:
            raise HalError(f"HarnessConfig.preempt_prob must be in [0, 1), got {self.preempt_prob}")
        if self.speculative_tokens < 0:
            raise HalError(f"HarnessConfig.speculative_tokens must be >= 0, got {self.speculative_tokens}")


@dataclass
class _Seq:
    index: int
    request: Request
    tokens: list[int]
    logprobs: list[torch.Tensor] = field(default_factory=list)
    computed: int = 0                   # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)
    preemptions: int = 0
    finish_reason: str = ""
    kept_pages: int = 0                 # leading pages offered to the prefix cache (prefix caching)
    cached_prompt_tokens: int = 0       # prompt tokens its first admission took from the prefix cache

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


@dataclass
class HarnessStats:
    """What the last ``generate`` did (tests use it to show that a schedule exercised something)."""

    steps: int = 0
    preemptions: int = 0
    cut_prefills: int = 0               # prefill chunks shorter than the remaining prompt
    mixed_steps: int = 0                # steps with prefill chunks and decodes in one batch
    rows: list[int] = field(default_factory=list)      # query rows per step
    draft_tokens: int = 0               # speculative drafts proposed
    accepted_tokens: int = 0            # of which accepted
    cached_tokens: int = 0              # tokens admissions took from the prefix cache instead of computing

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class _PagePool:
    """The harness's KV pages: the allocator's free pages, how many sequences hold each page in use,
    and with prefix caching the full pages kept under their prefix (the tokens from position 0 through
    the page's last), in least-recently-used order."""

    def __init__(self, num_pages: int, page_size: int, seed: int, caching: bool):
        self.allocator = PageAllocator(num_pages, torch.Generator().manual_seed(seed))
        self.free = num_pages
        self.page_size = page_size
        self.caching = caching
        self.holders: dict[int, int] = {}
        self.kept: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    def available(self) -> int:
        """Pages a sequence can get now: free ones and kept ones nobody holds."""
        return self.free + sum(1 for page in self.prefix_of if page not in self.holders)

    def take(self, count: int) -> list[int]:
        while self.free < count:          # give back the least recently used kept page nobody holds
            key = next(k for k, page in self.kept.items() if page not in self.holders)
            page = self.kept.pop(key)
            del self.prefix_of[page]
            self.allocator.give_back([page])
            self.free += 1
        pages = self.allocator.take(count)
        self.free -= count
        for page in pages:
            self.holders[page] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.holders[page] -= 1
            if self.holders[page] == 0:
                del self.holders[page]
                if page not in self.prefix_of:
                    self.allocator.give_back([page])
                    self.free += 1

    def lookup(self, tokens: list[int]) -> list[int]:
        """The kept pages ``tokens`` begin with (held for the caller), leaving its last token to compute."""
        pages: list[int] = []
        if not self.caching:
            return pages
        for i in range((len(tokens) - 1) // self.page_size):
            page = self.kept.get(tuple(tokens[:(i + 1) * self.page_size]))
            if page is None:
                break
            self.kept.move_to_end(self.prefix_of[page])
            self.holders[page] = self.holders.get(page, 0) + 1
            pages.append(page)
        return pages

    def keep(self, seq: "_Seq") -> None:
        """Offer the sequence's full, computed pages not offered yet (a prefix kept already stays with its page)."""
        if not self.caching:
            return
        for i in range(seq.kept_pages, seq.computed // self.page_size):
            key = tuple(seq.tokens[:(i + 1) * self.page_size])
            page = seq.pages[i]
            if key not in self.kept and page not in self.prefix_of:
                self.kept[key] = page
                self.prefix_of[page] = key
        seq.kept_pages = max(seq.kept_pages, seq.computed // self.page_size)


class RolloutHarness:
    """Generates completions for a list of requests with ``model`` on ``model.backend``."""

    def __init__(self, model: DecoderLM, config: HarnessConfig | None = None, *,
                 draft_model: DecoderLM | None = None):
        """``draft_model``: drafts for speculative decoding come from this small model (same vocabulary)
        instead of prompt lookup; needs ``config.speculative_tokens > 0``."""
        self.model = model
        self.config = config or HarnessConfig()
        self.stats = HarnessStats()
        if draft_model is not None:
            if not self.config.speculative_tokens:
                raise HalError("rollout harness: a draft_model drafts for speculative decoding; set "
                               "HarnessConfig.speculative_tokens > 0 (drafts per decode) to use it")
            self.drafter = ModelDrafter(draft_model, self.config.page_size)
            self.drafter.check_target(model)
        else:
            self.drafter = NgramDrafter()

    # -- checks ---------------------------------------------------------------------------------

    def _check(self, requests: Sequence[Request], num_pages: int) -> None:
        c = self.model.full_config
        for i, r in enumerate(requests):
            if not r.prompt:
                raise HalError(f"request {i}: empty prompt")
            if r.max_new_tokens < 1:
                raise HalError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
            if r.temperature < 0:
                raise HalError(f"request {i}: temperature must be >= 0, got {r.temperature}")
            bad = [t for t in r.prompt if not 0 <= t < c.vocab_size]
            if bad:
                raise HalError(f"request {i}: prompt token ids {bad[:5]} are outside the vocabulary "
                               f"0..{c.vocab_size - 1}")
            total = len(r.prompt) + r.max_new_tokens
            if total > c.max_position:
                raise HalError(f"request {i}: prompt {len(r.prompt)} + max_new_tokens {r.max_new_tokens} exceeds "
                               f"max_position {c.max_position}")
            if pages_needed(total, self.config.page_size) > num_pages:
                raise HalError(f"request {i} needs {pages_needed(total, self.config.page_size)} pages of "
                               f"{self.config.page_size} but the cache has {num_pages}; raise num_pages")

    # -- the loop -------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], *, trace: OpTrace | None = None,
                 trace_request: int = 0) -> list[Completion]:
        """Run every request to completion. With ``trace``, the ops of request ``trace_request``
        are captured at each position (the first computation of each position is kept)."""
        cfg = self.config
        page = cfg.page_size
        num_pages = cfg.num_pages or sum(pages_needed(len(r.prompt) + r.max_new_tokens, page) for r in requests) + 1
        self._check(requests, num_pages)
        if trace is not None and (cfg.speculative_tokens or cfg.prefix_caching):
            raise HalError("rollout harness: op tracing keeps the first computation of each position, which "
                           "with speculative_tokens > 0 may be a rejected draft's and with prefix_caching may "
                           "never happen; trace without them")
        rng = random.Random(cfg.seed)
        max_chunk = cfg.max_chunk or cfg.max_batch_tokens
        caches = self.model.allocate_kv_cache(num_pages, page)
        pool = _PagePool(num_pages, page, cfg.seed, cfg.prefix_caching)
        self.stats = stats = HarnessStats()
        if cfg.speculative_tokens:
            self.drafter.start(len(requests), max(len(r.prompt) + r.max_new_tokens for r in requests))
        seqs = [_Seq(i, r, list(r.prompt)) for i, r in enumerate(requests)]
        waiting = list(seqs)
        rng.shuffle(waiting)
        running: list[_Seq] = []
        device = self.model.device

        def preempt(seq: _Seq) -> None:
            pool.release(seq.pages)
            seq.pages, seq.computed, seq.kept_pages = [], 0, 0
            seq.preemptions += 1
            stats.preemptions += 1
            running.remove(seq)
            waiting.append(seq)
            log.debug("preempted request %d at %d tokens", seq.index, len(seq.tokens))

        while waiting or running:
            stats.steps += 1
            if running and rng.random() < cfg.preempt_prob:
                preempt(rng.choice(running))
            slots_open = cfg.max_num_seqs - len(running)
            if waiting and slots_open > 0:
                for _ in range(rng.randint(0 if running else 1, min(slots_open, len(waiting)))):
                    running.append(waiting.pop(rng.randrange(len(waiting))))

            scheduled: list[tuple[_Seq, int]] = []
            budget = cfg.max_batch_tokens
            order = list(running)
            rng.shuffle(order)
            for seq in order:
                if budget == 0:
                    break
                if seq not in running:
                    continue
                if not seq.pages and pool.caching:       # admitted (again): start after the kept prefix
                    seq.pages = pool.lookup(seq.tokens)
                    seq.kept_pages = len(seq.pages)            # kept already: the prefix they hold
                    seq.computed = len(seq.pages) * page
                    stats.cached_tokens += seq.computed
                    if not seq.preemptions and not seq.generated:
                        seq.cached_prompt_tokens = seq.computed
                remaining = len(seq.tokens) - seq.computed
                n = 1 if remaining == 1 else min(remaining, budget, rng.randint(1, max_chunk))
                room = 0
                if remaining == 1 and cfg.speculative_tokens:
                    # room for drafts (proposed below, for the whole step at once); drafts past the
                    # request's last token would be sampled for nothing
                    room = max(0, min(cfg.speculative_tokens, budget - 1,
                                      seq.request.max_new_tokens - seq.generated - 1))
                    n = 1 + room
                # (a sequence may hold more pages than it needs: rejected drafts' pages stay with it)
                need = max(0, pages_needed(seq.computed + n, page) - len(seq.pages))
                busy = {id(s) for s, _, _ in scheduled}
                while need > pool.available():   # out of pages: preempt the latest admitted request not yet scheduled
                    victims = [s for s in running if s is not seq and id(s) not in busy]
                    if not victims:
                        break
                    preempt(victims[-1])
                if need > pool.available():
                    continue        # it waits for pages held by this step's batch
                seq.pages += pool.take(need)
                stats.cut_prefills += int(remaining > 1 and n < remaining)
                scheduled.append((seq, n, room))
                budget -= n
            if not scheduled:
                raise HalError("rollout harness made no progress in a step (no request could be scheduled); "
                               "this is a bug: please report it with the HarnessConfig")
            scheduled = self._draft(scheduled, stats)
            self._step(scheduled, caches, device, stats, trace, trace_request)
            for seq, _, _ in scheduled:
                pool.keep(seq)
            for seq in [s for s in running if s.finish_reason]:
                pool.release(seq.pages)
                seq.pages = []
                running.remove(seq)
                if cfg.speculative_tokens:
                    self.drafter.finish(seq.index)

        return [Completion(s.request, s.tokens[len(s.request.prompt):],
                           torch.stack(s.logprobs) if s.logprobs else torch.zeros(0),
                           s.finish_reason, s.preemptions, cached_prompt_tokens=s.cached_prompt_tokens)
                for s in seqs]

    def _draft(self, scheduled, stats) -> list[tuple[_Seq, int, list[int]]]:
        """(sequence, rows, drafts) from (sequence, rows, room for drafts): one drafter call for the step's
        decoding sequences; a sequence keeps 1 + len(drafts) rows (its pages and budget for the room are
        not given back: it may hold a page more than it needs, as after a rejected draft)."""
        wants = [(seq.index, seq.tokens, room) for seq, _, room in scheduled if room]
        proposed = iter(self.drafter.propose(wants)) if wants else iter(())
        out = []
        for seq, n, room in scheduled:
            drafts = next(proposed)[:room] if room else []
            stats.draft_tokens += len(drafts)
            out.append((seq, 1 + len(drafts) if room else n, drafts))
        return out

    def _step(self, scheduled, caches, device, stats, trace, trace_request) -> None:
        """One forward over the scheduled (sequence, query rows, drafts), then sampling: a sequence whose
        rows reach its last token samples the next one; one with drafts samples at every row (``_accept``)."""
        page = self.config.page_size
        ids, positions, slots, q_lens, seq_lens, page_lists, logits_rows = [], [], [], [], [], [], []
        sampling: list[tuple[_Seq, int]] = []        # (sequence, position of the token sampled)
        sampled: list[tuple[_Seq, list[int]]] = []    # (sequence, its drafts), in sampling's order
        watch_rows, watch_positions = [], []
        rows = 0
        for seq, n, drafts in scheduled:
            lo, hi = seq.computed, seq.computed + n
            ids.extend((seq.tokens + drafts)[lo:hi])
            positions.extend(range(lo, hi))
            slots.append(slot_mapping(seq.pages, range(lo, hi), page, device))
            q_lens.append(n)
            seq_lens.append(hi)
            page_lists.append(list(seq.pages))
            if seq.index == trace_request:
                watch_rows.extend(range(rows, rows + n))
                watch_positions.extend(range(lo, hi))
            rows += n
            if hi >= len(seq.tokens):          # the last token's row, then one row per draft
                first = rows - 1 - len(drafts)
                logits_rows.extend(range(first, rows))
                sampling.extend((seq, len(seq.tokens) + j) for j in range(1 + len(drafts)))
                sampled.append((seq, drafts))
        stats.rows.append(rows)
        decodes = sum(1 for seq, n, _ in scheduled if seq.generated > 0 and seq.computed == len(seq.tokens) - 1)
        stats.mixed_steps += int(0 < decodes < len(scheduled))
        batch = InferenceBatch(torch.tensor(ids, dtype=torch.long, device=device),
                               torch.tensor(positions, dtype=torch.long, device=device),
                               torch.cat(slots), build_metadata(q_lens, seq_lens, page_lists, device),
                               torch.tensor(logits_rows, dtype=torch.long, device=device))
        watch = contextlib.nullcontext()
        if trace is not None and watch_rows:
            watch = trace.watch(watch_rows, watch_positions,
                                call=f"rollout step {stats.steps}: {len(scheduled)} sequences, {rows} rows")
        with watch:
            logits = self.model.forward_infer(batch, caches, trace=trace)
            for seq, n, drafts in scheduled:
                if not drafts:
                    seq.computed += n
            if not sampling:
                return
            tokens = sample_tokens(logits[:len(sampling)], [s.request.seed for s, _ in sampling],
                                   [p for _, p in sampling], [s.request.temperature for s, _ in sampling]).tolist()
            logprobs: list[torch.Tensor | None] = [None] * len(sampling)
            # one token_logprobs call per temperature (a row's bits do not depend on its batch-mates)
            for temperature in sorted({s.request.logprob_temperature for s, _ in sampling}):
                idx = [i for i, (s, _) in enumerate(sampling) if s.request.logprob_temperature == temperature]
                index = torch.tensor(idx, dtype=torch.long, device=device)
                token_ids = torch.tensor([tokens[i] for i in idx], dtype=torch.long, device=device)
                values = self.model.next_token_logprobs(logits[index], token_ids, temperature).cpu()
                if trace is not None:
                    trace.record("logprob", values.unsqueeze(-1), batch.logits_rows[index])
                for j, i in enumerate(idx):
                    logprobs[i] = values[j]
        at = 0
        for seq, drafts in sampled:
            targets = list(zip(tokens[at:at + 1 + len(drafts)], logprobs[at:at + 1 + len(drafts)]))
            at += 1 + len(drafts)
            if drafts:
                self._accept(seq, drafts, targets, stats)
            else:
                self._append(seq, *targets[0])

    @staticmethod
    def _append(seq: _Seq, token: int, logprob: torch.Tensor) -> bool:
        """Append one sampled token; True when the request finished with it."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        if token in seq.request.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.generated >= seq.request.max_new_tokens:
            seq.finish_reason = "length"
        return bool(seq.finish_reason)

    def _accept(self, seq: _Seq, drafts: list[int], targets, stats) -> None:
        """The target tokens up to the first rejected draft: target 0 is plain decoding's next token;
        target j (j >= 1) was computed after draft j, valid only if draft j equals target j - 1. The
        cache holds correct K/V for the last token and every accepted draft."""
        lo = len(seq.tokens) - 1
        accepted = 0
        for j, (token, logprob) in enumerate(targets):
            if j > 0:
                if drafts[j - 1] != targets[j - 1][0]:
                    break
                accepted += 1
            if self._append(seq, token, logprob):
                break
        stats.accepted_tokens += accepted
        seq.computed = lo + 1 + accepted
