"""The Backend interface: the ops the trainer and the rollout engine call.

A backend is a class registered under the entry-point group ``hal.backends``. Identity is class
attributes; ``probe()`` is a cheap classmethod that says whether the backend can run here and,
if not, exactly why; an instance is bound to one contract (or none, for the stock baseline) and
one device. Importing a backend's module must be cheap: heavy imports (triton, torch_npu) belong
inside ``probe()`` and ``__init__``.

Shapes use these letters: T tokens (packed, all sequences), B sequences, H heads, D head dim,
K reduced dim, N output features, V vocabulary, P page size.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch

from hal.contract import Contract
from hal.errors import ContractMismatchError, UnsupportedError

if TYPE_CHECKING:
    from hal.moe import Routing


@dataclass(frozen=True)
class Probe:
    """Whether a backend can run here. ``reason`` says exactly what is missing when it cannot."""

    available: bool
    reason: str = ""
    device: str = ""
    details: dict = field(default_factory=dict)

    @classmethod
    def ok(cls, device: str, **details) -> "Probe":
        return cls(True, "", device, details)

    @classmethod
    def missing(cls, reason: str, **details) -> "Probe":
        return cls(False, reason, "", details)


@dataclass(frozen=True)
class Allowed:
    """The values of one contract key that a backend realises: ``check`` decides, ``says`` is how the
    refusal and ``hal doctor`` put it."""

    says: str
    check: Callable[[Any], bool] = field(compare=False)
    #: exactly one value (an enumerated choice the backend implements, not a range of numbers)
    single: bool = False

    @classmethod
    def one_of(cls, *values: Any) -> "Allowed":
        return cls(" or ".join(repr(v) for v in values), lambda v: v in values, single=len(values) == 1)

    @classmethod
    def powers_of_two(cls, low: int, high: int) -> "Allowed":
        return cls(f"a power of two in {low}..{high}", lambda v: low <= v <= high and v & (v - 1) == 0)

    @classmethod
    def multiples_of(cls, step: int) -> "Allowed":
        return cls(f"a multiple of {step}", lambda v: v > 0 and v % step == 0)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can realise, as data: checked when the backend is bound to a contract (a contract
    it cannot realise is refused then, with the reason, not at the first launch), checked by the ops
    (head dims), read by the conformance kit (``unsupported``) and shown by ``hal doctor``.

    ``contract_values`` maps a contract key (``"attention.kv_chunk"``) to the values the backend
    realises; a key that is not listed is realised for every value the contract schema accepts."""

    #: names of the contracts it realises (empty: no invariance claims, e.g. the baseline)
    contracts: tuple[str, ...] = ()
    #: activation dtypes it realises them for
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    #: (op, dtype) combinations it declares missing, e.g. (("attention", torch.float32),); the
    #: conformance kit does not test them and reports them as unsupported instead of failing them
    unsupported: tuple[tuple[str, torch.dtype], ...] = ()
    #: attention head dims (None: any)
    head_dims: tuple[int, ...] | None = None
    #: KV-cache page sizes (None: any)
    page_sizes: tuple[int, ...] | None = None
    #: "section.key" -> the values of that contract key it realises
    contract_values: Mapping[str, Allowed] = field(default_factory=dict)

    def refusals(self, contract: Contract) -> list[str]:
        """Why ``contract`` cannot be realised: one line per contract value outside ``contract_values``
        (empty: it can be)."""
        reasons = []
        for key, allowed in self.contract_values.items():
            section, name = key.split(".")
            if getattr(contract, section) is None:   # an optional section the contract leaves out
                continue
            value = getattr(getattr(contract, section), name)
            if not allowed.check(value):
                reasons.append(f"[{section}].{name} = {value!r} (realised: {allowed.says})")
        return reasons

    def table(self) -> list[tuple[str, str]]:
        """(what, values) rows for ``hal doctor``."""
        def listed(values):
            return "any" if values is None else ", ".join(str(v) for v in values) or "none"
        rows = [("contracts", listed(self.contracts) if self.contracts else "none (baseline)"),
                ("dtypes", listed(str(d).removeprefix("torch.") for d in self.dtypes)),
                ("head dims", listed(self.head_dims)), ("page sizes", listed(self.page_sizes))]
        if self.unsupported:
            rows.append(("not realised", ", ".join(f"{op} {str(d).removeprefix('torch.')}"
                                                   for op, d in self.unsupported)))
        choices = [key for key, allowed in self.contract_values.items() if allowed.single]
        rows += [(f"[{key.replace('.', '].', 1)}", allowed.says) for key, allowed in self.contract_values.items()
                 if not allowed.single]
        if choices:
            rows.append(("enumerated keys", f"{len(choices)} pinned to one value each (the values of "
                                            f"`hal contract show`)"))
        return rows


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries and keys are, for one call of ``Backend.attention``.

    query_start_loc: (B+1,) int32, the packed queries of sequence b are rows
        ``query_start_loc[b]:query_start_loc[b+1]`` of q.
    seq_lens: (B,) int32, the context length of sequence b *including* this call's queries; its
        queries sit at absolute positions ``seq_lens[b] - q_len_b ... seq_lens[b] - 1``.
    block_table: (B, max_pages) int32, page ids of sequence b in order; key j of sequence b lives
        in page ``block_table[b, j // P]`` at row ``j % P``.

    Prefill is ``q_len == seq_len``; chunked prefill ``1 < q_len < seq_len``; decode ``q_len == 1``.
    Training passes contiguous pages. Every query attends causally to keys 0..its position.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def host_lists(self) -> tuple[list[int], list[int], list[list[int]]]:
        """(query_start_loc, seq_lens, block_table) as Python lists, for host-side loops."""
        return (self.query_start_loc.tolist(), self.seq_lens.tolist(), self.block_table.tolist())


class Backend(abc.ABC):
    """Base class of every backend. Subclasses set the class attributes and implement the ops."""

    #: short, user-visible name; equal to the entry-point name
    name: ClassVar[str]
    #: one line for ``hal doctor``
    description: ClassVar[str] = ""
    #: "accelerator" backends take part in automatic selection; "cpu" and "baseline" do not
    kind: ClassVar[str] = "accelerator"
    #: what it realises (contracts, dtypes, head dims, page sizes, contract values), as data
    capabilities: ClassVar[Capabilities] = Capabilities()
    # ``contracts``, ``dtypes`` and ``unsupported`` are the capabilities' fields, mirrored as class
    # attributes (the registry, the kit and integrations read them); a subclass declares either the
    # whole ``capabilities`` or overrides one of the three, and ``__init_subclass__`` keeps both in step.
    contracts: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[torch.dtype, ...]] = Capabilities.dtypes
    unsupported: ClassVar[tuple[tuple[str, torch.dtype], ...]] = ()

    def __init__(self, contract: Contract | None, device: torch.device | str | None = None):
        if contract is not None:
            self.check_realises(contract)
        self.contract = contract
        self.device = torch.device(device) if device is not None else self.default_device()

    @classmethod
    def check_realises(cls, contract: Contract, capabilities: Capabilities | None = None) -> None:
        """Refuse, when it is bound, a contract this backend cannot realise: one it does not name, or
        one whose values lie outside its capabilities (``capabilities``: a narrower set chosen at
        construction, e.g. by an implementation path)."""
        capabilities = capabilities or cls.capabilities
        if contract.name not in capabilities.contracts:
            raise ContractMismatchError(
                f"backend {cls.name!r} does not realise contract {contract.name!r}; it realises: "
                f"{', '.join(capabilities.contracts) or 'no contract (it is a non-conforming baseline)'}")
        refusals = capabilities.refusals(contract)
        if refusals:
            raise UnsupportedError(
                f"backend {cls.name!r} cannot realise contract {contract} from {contract.source}: "
                f"{'; '.join(refusals)}. Use a contract within these values (`hal doctor` lists each "
                f"backend's) or another backend")

    def check_head_dim(self, op: str, head_dim: int) -> None:
        if self.capabilities.head_dims is not None and head_dim not in self.capabilities.head_dims:
            raise UnsupportedError(f"{self.name}.{op}: head dim {head_dim} is not realised; supported: "
                                   f"{list(self.capabilities.head_dims)}")

    # -- identity -----------------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> Probe:
        """Cheap check: can this backend run here? Never raises for a missing dependency."""

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("cpu")

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the contract this instance realises (None for a baseline)."""
        return self.contract.fingerprint if self.contract is not None else None

    def check_dtype(self, op: str, *tensors: torch.Tensor) -> torch.dtype:
        """The common activation dtype of ``tensors``; raise if this backend does not realise it."""
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            if t.dtype != dtype:
                raise UnsupportedError(f"{self.name}.{op}: all inputs must share one dtype, got "
                                       f"{[str(t.dtype) for t in tensors]}")
        if dtype not in self.dtypes:
            raise UnsupportedError(f"{self.name}.{op}: dtype {dtype} is not realised; supported: "
                                   f"{[str(d) for d in self.dtypes]}")
        covered = self.contract.header.activation_dtypes if self.contract is not None else None
        if covered is not None and str(dtype).removeprefix("torch.") not in covered:
            raise UnsupportedError(f"{self.name}.{op}: dtype {dtype} is not covered by contract {self.contract}, "
                                   f"whose [contract].activation_dtypes = {list(covered)}; use one of those or a "
                                   f"contract that covers {dtype}")
        return dtype

    def check_not_meta(self, op: str, *tensors: torch.Tensor | None) -> None:
        """Meta tensors have no values: no op can compute (or check) anything on them."""
        for t in tensors:
            if t is not None and t.is_meta:
                raise UnsupportedError(f"{self.name}.{op}: got a meta tensor {tuple(t.shape)} {t.dtype}, which "
                                       f"holds no values; pass tensors on {self.device}")

    def check_devices(self, op: str, *tensors: torch.Tensor | None) -> None:
        """Raise unless every given tensor lives on this backend's device type."""
        device_type = self.device.type
        for t in tensors:
            if t is not None and t.device.type != device_type:
                raise UnsupportedError(f"{self.name}.{op}: tensors must be on {self.device}, got {t.device}")

    def check_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype | None) -> torch.dtype:
        """Validate ``linear``'s arguments; return the output dtype (default: the activation dtype)."""
        dtype = self.check_dtype("linear", x, weight)
        if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise UnsupportedError(f"{self.name}.linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                                   f"match (weight must be (N, K) with K = x.shape[-1])")
        if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != dtype):
            raise UnsupportedError(f"{self.name}.linear: bias must be ({weight.shape[0]},) {dtype}, got "
                                   f"{tuple(bias.shape)} {bias.dtype}")
        out_dtype = out_dtype or dtype
        if out_dtype not in (dtype, torch.float32):
            raise UnsupportedError(f"{self.name}.linear: out_dtype must be {dtype} or torch.float32, got {out_dtype}")
        return out_dtype

    def check_rotary(self, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.dtype:
        dtype = self.check_dtype("rotary", q, k)
        rot = cos_sin_cache.shape[-1]
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or rot % 2 or rot > q.shape[-1]:
            raise UnsupportedError(f"{self.name}.rotary: cos_sin_cache must be fp32 (max_pos, R) with even R <= head "
                                   f"dim, got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
        return dtype

    def check_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
        dtype = self.check_dtype("rms_norm", *([x, weight] if residual is None else [x, weight, residual]))
        if weight.shape != (x.shape[-1],):
            raise UnsupportedError(f"{self.name}.rms_norm: weight must be ({x.shape[-1]},) for x {tuple(x.shape)}, "
                                   f"got {tuple(weight.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise UnsupportedError(f"{self.name}.rms_norm: residual must have x's shape {tuple(x.shape)}, got "
                                   f"{tuple(residual.shape)}")
        return dtype

    def check_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, *, fp8_cache: bool = False) -> None:
        """Dtypes (caches in q's dtype, or with ``fp8_cache`` checked by the caller), shapes, then the
        metadata's values: every sequence's keys fit in the pages its block-table row names and its
        queries in its context. A kernel reads past a short block-table row without noticing (the next
        row's page ids), so this is refused here."""
        if fp8_cache:
            self.check_dtype("fp8_attention", q)
        else:
            self.check_dtype("attention", q, k_cache, v_cache)
        if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
            raise UnsupportedError(f"{self.name}.attention: expected q (T, Hq, D) and k_cache, v_cache of one shape "
                                   f"(pages, P, Hkv, D); got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                                   f"v_cache {tuple(v_cache.shape)}")
        if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
            raise UnsupportedError(f"{self.name}.attention: head dim {q.shape[2]} vs cache {k_cache.shape[3]}, or "
                                   f"{q.shape[1]} query heads not a multiple of {k_cache.shape[2]} KV heads")
        num_seqs = meta.seq_lens.shape[0]
        if (meta.query_start_loc.shape != (num_seqs + 1,) or meta.block_table.dim() != 2
                or meta.block_table.shape[0] != num_seqs):
            raise UnsupportedError(f"{self.name}.attention: metadata for {num_seqs} sequences needs query_start_loc "
                                   f"({num_seqs + 1},) and block_table ({num_seqs}, pages); got "
                                   f"{tuple(meta.query_start_loc.shape)} and {tuple(meta.block_table.shape)}")
        if _values_checked(meta):
            return
        page, width = k_cache.shape[1], meta.block_table.shape[1]
        seq_lens = meta.seq_lens.long()
        q_lens = meta.query_start_loc[1:].long() - meta.query_start_loc[:-1].long()
        bad = (-(-seq_lens // page) > width) | (q_lens < 0) | (q_lens > seq_lens)
        if num_seqs and bool(bad.any() | (meta.query_start_loc[-1] > q.shape[0])):  # one host synchronisation
            if int(meta.query_start_loc[-1]) > q.shape[0]:
                raise UnsupportedError(f"{self.name}.attention: query_start_loc ends at "
                                       f"{int(meta.query_start_loc[-1])} but q has {q.shape[0]} tokens")
            b = int(bad.nonzero()[0, 0])
            raise UnsupportedError(
                f"{self.name}.attention: sequence {b} has seq_len {int(seq_lens[b])} and {int(q_lens[b])} queries, "
                f"but its block-table row holds {width} pages of {page} keys ({width * page} keys) and a sequence "
                f"needs 0 <= queries <= seq_len: give the block table at least ceil(seq_len / page_size) pages per "
                f"sequence")
        _mark_values_checked(meta)

    def check_positions(self, positions: torch.Tensor, tokens: int, max_position: int) -> None:
        """Rotary positions: one per token, each in 0..max_position-1 (the cos/sin table's rows)."""
        if positions.shape != (tokens,):
            raise UnsupportedError(f"{self.name}.rotary: positions must be ({tokens},), one per token of q and k, got "
                                   f"{tuple(positions.shape)}")
        if tokens and not _values_checked(positions):
            low, high = torch.stack(torch.aminmax(positions)).tolist()  # one host synchronisation
            if low < 0 or high >= max_position:
                raise UnsupportedError(f"{self.name}.rotary: positions must be in 0..{max_position - 1} (the "
                                       f"cos_sin_cache rows), got {low}..{high}; build a longer table with "
                                       f"hal.rope.cos_sin_cache if the sequence is longer")
            _mark_values_checked(positions)

    def check_expert_ids(self, ids: torch.Tensor, num_experts: int) -> None:
        """MoE expert ids in 0..num_experts-1 (checked once per tensor contents on an accelerator, like
        positions; ids from ``moe_route`` are marked checked there, so a layer pays no synchronisation)."""
        if ids.numel() and not _values_checked(ids):
            low, high = torch.stack(torch.aminmax(ids.reshape(-1))).tolist()   # one host synchronisation
            if low < 0 or high >= num_experts:
                raise UnsupportedError(f"{self.name}.moe_experts: expert ids must be in 0..{num_experts - 1}, got "
                                       f"{low}..{high}")
            _mark_values_checked(ids)

    def check_topk(self, x: torch.Tensor, k: int) -> None:
        if not 0 < k <= x.shape[-1]:
            raise UnsupportedError(f"{self.name}.topk: k must be in 1..{x.shape[-1]}, got {k}")

    def check_logits(self, logits: torch.Tensor, temperature: float, op: str = "log_softmax") -> None:
        if logits.dim() != 2:
            raise UnsupportedError(f"{self.name}.{op}: logits must be (M, V), got {tuple(logits.shape)}")
        if not temperature > 0:
            raise UnsupportedError(f"{self.name}.{op}: temperature must be > 0, got {temperature}")

    def check_token_ids(self, logits: torch.Tensor, token_ids: torch.Tensor) -> None:
        if token_ids.shape != (logits.shape[0],):
            raise UnsupportedError(f"{self.name}.token_logprobs: token_ids must be ({logits.shape[0]},), one per "
                                   f"logits row, got {tuple(token_ids.shape)} for logits {tuple(logits.shape)}")

    def __repr__(self) -> str:
        bound = str(self.contract) if self.contract is not None else "no contract"
        return f"<{type(self).__name__} {self.name!r} on {self.device} realising {bound}>"

    def __init_subclass__(cls, **kwargs):
        """Every op a subclass defines runs the shared input checks first (``_INPUT_CHECKS``): one
        place, so no backend can forget one, and an empty batch never reaches a kernel."""
        super().__init_subclass__(**kwargs)
        overrides = {k: cls.__dict__[k] for k in ("contracts", "dtypes", "unsupported") if k in cls.__dict__}
        if "capabilities" in cls.__dict__ or overrides:
            cls.capabilities = dataclasses.replace(cls.capabilities, **overrides)
        cls.contracts = cls.capabilities.contracts
        cls.dtypes = cls.capabilities.dtypes
        cls.unsupported = cls.capabilities.unsupported
        for op, check in _INPUT_CHECKS.items():
            impl = cls.__dict__.get(op)
            if impl is not None and not getattr(impl, "_hal_checked", False):
                setattr(cls, op, _checked(impl, check))

    # -- ops ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``.

        x: (..., K); weight: (N, K) in nn.Linear layout; bias: (N,) or None. Accumulates in fp32
        over K as the contract's [gemm] says, adds the bias in fp32, rounds once to ``out_dtype``
        (default: x.dtype; ``torch.float32`` for logits).
        """

    @abc.abstractmethod
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """Causal GQA attention of packed variable-length queries over a paged KV cache.

        q: (T, Hq, D); k_cache, v_cache: (num_pages, P, Hkv, D); returns (T, Hq, D) in q's dtype.
        One op for prefill, chunked prefill, decode and training, following [attention].
        """

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store k, v (T, Hkv, D) at flat slots ``page * P + row`` (T,) of the caches; slot -1 skips.

        The default is an exact indexed copy (no arithmetic, so nothing for a contract to pin); a
        backend overrides it only for speed.
        """
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        page_size = k_cache.shape[1]
        # (page, row) indexing writes through any strides: the caches may be views into an engine's
        # own buffer (vLLM's CPU cache keeps K and V side by side per head).
        k_cache[slots // page_size, slots % page_size] = k[keep]
        v_cache[slots // page_size, slots % page_size] = v[keep]

    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over the last dim, with an optional fused residual add.

        Without residual: returns ``norm(x) * weight``. With residual: ``r = x + residual`` rounded to
        the activation dtype, returns ``(norm(r) * weight, r)``, as [rms_norm] says.
        """

    @abc.abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(g) * u`` where gate_up is (..., 2I) = [g | u]; returns (..., I), as [silu_mul] says."""

    @abc.abstractmethod
    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style rotary embedding of q (T, Hq, D) and k (T, Hkv, D) at positions (T,).

        cos_sin_cache: (max_position, R) fp32, ``[cos | sin]`` halves of R/2 each, built by
        ``hal.rope.cos_sin_cache`` (one table shared by every backend). The first R dims rotate.
        """

    @abc.abstractmethod
    def log_softmax(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """fp32 log-softmax over the last dim (V) of (M, V) logits, as [logprobs] says."""

    @abc.abstractmethod
    def token_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
        """fp32 (M,) log-probability of ``token_ids`` (M,) under softmax(logits / temperature)."""

    @abc.abstractmethod
    def sum(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """fp32 sum over ``dim``, as [reduce] says."""

    @abc.abstractmethod
    def mean(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """fp32 mean over ``dim``: the sum divided by the count, as [reduce] says."""

    @abc.abstractmethod
    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest along the last dim: (values, int64 indices), value-descending, ties to the lower index."""

    # Mixture-of-experts (``hal.moe``; the contract's [moe]). Not abstract: a backend without MoE
    # refuses them, and a dense model never calls them.

    def moe_route(self, router_logits: torch.Tensor, routing: "Routing",
                  correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens to experts: fp32 router logits (T, E) -> (fp32 weights (T, k), int32 expert
        ids (T, k)), ids in rank order. ``routing`` (``hal.moe.Routing``) is the model's scheme;
        ``correction_bias`` (E,) shifts the choice only (DeepSeek-V3)."""
        raise UnsupportedError(f"backend {self.name!r} does not realise mixture-of-experts layers "
                               f"(moe_route); use one that does (`hal doctor`)")

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for every token: x (T, H); w13 (E, 2I, H) rows [gate | up];
        w2 (E, H, I); topk_weights/ids (T, k) from ``moe_route``; shared (T, H): the shared experts'
        output, added before the single rounding. Returns (T, H) in x's dtype."""
        raise UnsupportedError(f"backend {self.name!r} does not realise mixture-of-experts layers "
                               f"(moe_experts); use one that does (`hal doctor`)")

    # Block-FP8 linears (``hal.fp8``; the contract's [fp8]). Not abstract: a backend without FP8
    # refuses them, and a bf16 model never calls them.

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ dequant(weight).T (+ bias)`` with x quantised to FP8 per 1 x 128 group, as [fp8] says.

        x: (..., K) activations (bf16/fp32), K a multiple of [fp8].activation_group; weight: (N, K)
        float8_e4m3fn; weight_scale_inv: (ceil(N/128), K/128) fp32, DeepSeek's layout (w = w_fp8 *
        scale_inv per block); bias: (N,) in x's dtype or None. Per K block of 128: an fp32 partial of
        the fp8 values, scaled by fl32(a_scale * w_scale_inv), added in ascending order in fp32 from
        +0; bias in fp32; one rounding to ``out_dtype`` (default x.dtype).
        """
        raise UnsupportedError(f"backend {self.name!r} does not realise FP8 linears (fp8_linear); use one that "
                               f"does (`hal doctor`)")

    def fp8_moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                        w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        shared: torch.Tensor | None = None) -> torch.Tensor:
        """``moe_experts`` with block-FP8 experts (DeepSeek-V3's): w13 (E, 2I, H) / w2 (E, H, I)
        float8_e4m3fn with fp32 block scales (E, 2I/B, H/B) / (E, H/B, I/B), DeepSeek's layout per expert.
        Each slot's MLP is ``fp8_linear`` / ``silu_mul`` / ``fp8_linear`` (fp32 out) of its token's row
        under [fp8]; the combine is [moe]'s. Needs a contract with both sections."""
        raise UnsupportedError(f"backend {self.name!r} does not realise FP8 mixture-of-experts layers "
                               f"(fp8_moe_experts); use one that does (`hal doctor`)")

    def fp8_write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantise k, v (T, Hkv, D) into an FP8 KV cache at flat slots ``page * P + row`` (slot -1 skips):
        caches (pages, P, Hkv, D) in [fp8].kv_format; ``per_token_head``: each (token, head) vector's scale
        by the scale rule, stored in k_scale / v_scale (pages, P, Hkv) fp32; ``fixed``: k_scale / v_scale
        are the layer's 0-dim fp32 scales. ``hal.fp8.Fp8KVCache`` holds such a cache."""
        raise UnsupportedError(f"backend {self.name!r} does not realise an FP8 KV cache (fp8_write_kv); use one "
                               f"that does (`hal doctor`)")

    def fp8_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor, meta: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """``attention`` over an FP8 KV cache (as ``fp8_write_kv`` fills it), read through [fp8]'s one
        read path in every phase: kv_dequant "fp32_multiply_round_act" reads ``round_act(fl32(fp32(x) *
        scale))``, the same bits as ``attention`` over the dequantised caches (``hal.fp8.dequantise_kv``);
        "f16_operands" (fixed scales) reads K and V as exact f16 operands with q and P rounded to f16, the
        K scale in the score factor and the V scale on the output (the contract's comment; the reference
        is ``hal.backends.reference.attention.paged_attention(..., fixed_scales=...)``)."""
        raise UnsupportedError(f"backend {self.name!r} does not realise an FP8 KV cache (fp8_attention); use one "
                               f"that does (`hal doctor`)")


    # Tensor parallelism (``hal.parallel``; the contract's [parallel]): what one rank computes and sends,
    # and how every rank combines what it received. Not abstract: the GEMM pair has a default built from
    # ``linear`` (right for every backend that realises [gemm]); the logprob triple has none.

    def linear_chunk_partials(self, x: torch.Tensor, weight: torch.Tensor, k_offset: int = 0) -> torch.Tensor:
        """The fp32 sums of the [gemm] K chunks of one K shard: x (..., Ks), weight (N, Ks), the shard
        starting at column ``k_offset`` of the full K (a multiple of k_chunk). Returns (C, M, N) fp32,
        C = ceil(Ks / k_chunk), M the rows of x; partial i is absolute chunk ``k_offset // k_chunk + i``,
        accumulated from zero as in [gemm] (no bias, no rounding to the activation dtype).

        The default runs ``linear`` on each chunk alone with fp32 output: by [gemm] a one-chunk linear
        is fl32(+0 + that chunk's sum), which is the chunk's sum (a -0 sum becomes +0, as the total
        it joins would make it). It holds for every backend whose chunk sum does not depend on where
        the chunk sits in K (the contract's "fixed per backend and per chunk width"); a backend whose
        sum does must override it. One launch per chunk: correct first, fast later."""
        spec = self.check_chunk_partials_inputs(x, weight, k_offset)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        parts = [self.linear(x2[:, start:end], weight[:, start:end], out_dtype=torch.float32)
                 for start, end in spec.chunk_ranges(k)]
        if not parts:
            return torch.zeros(0, x2.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        return torch.stack(parts)

    def combine_chunks(self, partials: torch.Tensor, bias: torch.Tensor | None = None, *,
                       out_dtype: torch.dtype) -> torch.Tensor:
        """[gemm]'s combine of chunk partials (C, M, N) fp32 given in ascending chunk order: total = +0,
        then total = fl32(total + partial_i) for i = 0 .. C-1, then fl32(total + bias) (bias (N,) in the
        activation dtype, upcast exactly), then one nearest-even rounding to ``out_dtype``. Returns (M, N).

        The default is elementwise IEEE fp32 arithmetic, which every torch device does exactly."""
        self.check_combine_inputs(partials, bias)
        total = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
        for part in partials:
            total = total + part
        if bias is not None:
            total = total + bias.float()
        return total.to(out_dtype)

    def check_chunk_partials_inputs(self, x: torch.Tensor, weight: torch.Tensor, k_offset: int):
        """``linear_chunk_partials``'s checks (every backend's override runs them): the [gemm] spec."""
        spec = self._gemm_spec("linear_chunk_partials")
        if k_offset < 0 or k_offset % spec.k_chunk:
            raise UnsupportedError(f"{self.name}.linear_chunk_partials: k_offset {k_offset} is not a multiple of "
                                   f"[gemm].k_chunk = {spec.k_chunk}; a K shard must start on a chunk boundary "
                                   f"(give each rank a whole number of chunks)")
        self.check_linear(x, weight, None, torch.float32)
        return spec

    def check_combine_inputs(self, partials: torch.Tensor, bias: torch.Tensor | None) -> None:
        """``combine_chunks``'s checks (every backend's override runs them)."""
        if partials.dim() != 3 or partials.dtype != torch.float32:
            raise UnsupportedError(f"{self.name}.combine_chunks: partials must be (C, M, N) fp32, got "
                                   f"{tuple(partials.shape)} {partials.dtype}")
        if bias is not None and bias.shape != (partials.shape[2],):
            raise UnsupportedError(f"{self.name}.combine_chunks: bias must be ({partials.shape[2]},), got "
                                   f"{tuple(bias.shape)}")

    def logprob_chunk_max(self, logits: torch.Tensor, temperature: float = 1.0, vocab_offset: int = 0) -> torch.Tensor:
        """Per [logprobs] vocab chunk of a vocab shard (logits (M, Vs), the shard starting at column
        ``vocab_offset``, a multiple of vocab_chunk): the max of x = fl32(logit / T). Returns (M, C) fp32."""
        raise UnsupportedError(f"backend {self.name!r} does not realise vocab-parallel logprobs "
                               f"(logprob_chunk_max); use one that does (`hal doctor`) or gather the logits")

    def logprob_chunk_sums(self, logits: torch.Tensor, row_max: torch.Tensor, temperature: float = 1.0,
                           vocab_offset: int = 0) -> torch.Tensor:
        """Per [logprobs] vocab chunk of a vocab shard: the chunk's sum of exp(fl32(x - row_max)), summed
        as ``token_logprobs`` sums that chunk on one device; row_max (M,) fp32 is the max of the whole
        row. Returns (M, C) fp32."""
        raise UnsupportedError(f"backend {self.name!r} does not realise vocab-parallel logprobs "
                               f"(logprob_chunk_sums); use one that does (`hal doctor`) or gather the logits")

    def logprob_combine(self, token_logits: torch.Tensor, row_max: torch.Tensor, chunk_sums: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
        """The end of ``token_logprobs`` from gathered pieces: S = +0 plus the chunk sums (M, C) of the
        whole row in ascending order (fp32), x_t = fl32(token_logit / T), logp = fl32(fl32(x_t - row_max)
        - log(S)). Returns (M,) fp32, bitwise ``token_logprobs`` of the full row."""
        raise UnsupportedError(f"backend {self.name!r} does not realise vocab-parallel logprobs "
                               f"(logprob_combine); use one that does (`hal doctor`) or gather the logits")

    def check_vocab_shard(self, op: str, logits: torch.Tensor, vocab_offset: int, temperature: float):
        """The vocab-parallel pieces' checks (every backend's implementation runs them): a shard starts on a
        [logprobs] vocab chunk. Returns the [logprobs] spec."""
        if self.contract is None:
            raise UnsupportedError(f"{self.name}.{op}: a baseline backend (no contract) has no vocab chunks to "
                                   f"expose; use a contract backend")
        chunk = self.contract.logprobs.vocab_chunk
        if vocab_offset < 0 or vocab_offset % chunk:
            raise UnsupportedError(f"{self.name}.{op}: vocab_offset {vocab_offset} is not a multiple of "
                                   f"[logprobs].vocab_chunk = {chunk}; a vocab shard must start on a chunk boundary")
        self.check_logits(logits, temperature, op)
        return self.contract.logprobs

    def _gemm_spec(self, op: str):
        if self.contract is None:
            raise UnsupportedError(f"{self.name}.{op}: a baseline backend (no contract) has no K chunks to expose; "
                                   f"use a contract backend")
        return self.contract.gemm


# -- the shared input checks, run before every op of every backend ---------------------------------
# Each takes the op's arguments and returns None (go on to the backend) or the op's result for an
# empty batch (0 rows: returned as torch does, without launching anything).


def _value_stamp(obj: AttentionMetadata | torch.Tensor):
    """What identifies the values of ``obj`` (attention metadata, rotary positions) for the value
    checks: None means "check now".

    On the CPU values are read for free: every call checks (None). On an accelerator reading a value
    is a host synchronisation, so it happens once per object and contents: a model's layers share
    one metadata object and one positions tensor per step, so a step pays one synchronisation, not
    one per layer; the version counters move with every in-place write, so a reused buffer refilled
    is checked again. While a CUDA graph is captured no value can be read at all ("capturing": the
    engine ran the same shapes eagerly before). Inference tensors (made under ``torch.inference_mode``,
    as vLLM runs its forward) have no version counter, so nothing would notice a refill: they are
    checked at every call (None), and marking one records nothing."""
    tensors = (obj.query_start_loc, obj.seq_lens, obj.block_table) if isinstance(obj, AttentionMetadata) else (obj,)
    if tensors[0].device.type == "cpu":
        return None
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return "capturing"
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def _values_checked(obj: AttentionMetadata | torch.Tensor) -> bool:
    stamp = _value_stamp(obj)
    return stamp == "capturing" or (stamp is not None and getattr(obj, "_hal_checked_stamp", None) == stamp)


def mark_values_checked(obj: AttentionMetadata | torch.Tensor) -> None:
    """Record that ``obj``'s values are valid by construction (a backend's own outputs, e.g. expert ids),
    so the shared checks do not synchronise to read them."""
    _mark_values_checked(obj)


def _mark_values_checked(obj: AttentionMetadata | torch.Tensor) -> None:
    stamp = _value_stamp(obj)
    if stamp is not None:
        object.__setattr__(obj, "_hal_checked_stamp", stamp)   # AttentionMetadata is frozen: set on purpose



def _rows(x: torch.Tensor) -> int:
    """Rows of a (..., N) tensor: the product of the leading dims."""
    return x.shape[:-1].numel()


_NOTHING = object()  # write_kv with no tokens: nothing to store, return None


def _linear_input(self, x, weight, bias=None, *, out_dtype=None):
    self.check_not_meta("linear", x, weight, bias)
    out_dtype = self.check_linear(x, weight, bias, out_dtype)
    if x.dim() and _rows(x) == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)
    return None


def _attention_input(self, q, k_cache, v_cache, meta, *, scale):
    self.check_not_meta("attention", q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table)
    self.check_attention(q, k_cache, v_cache, meta)
    self.check_head_dim("attention", q.shape[-1])
    return torch.empty_like(q) if q.shape[0] == 0 else None


def _write_kv_input(self, k, v, k_cache, v_cache, slot_mapping):
    self.check_not_meta("write_kv", k, v, k_cache, v_cache, slot_mapping)
    self.check_dtype("write_kv", k, v, k_cache, v_cache)
    if slot_mapping.shape != (k.shape[0],) or v.shape != k.shape:
        raise UnsupportedError(f"{self.name}.write_kv: k and v must be one shape (T, Hkv, D) with one slot per "
                               f"token; got k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)}")
    return _NOTHING if k.shape[0] == 0 else None


def _rms_norm_input(self, x, weight, eps, residual=None):
    self.check_not_meta("rms_norm", x, weight, residual)
    self.check_rms_norm(x, weight, residual)
    if _rows(x) == 0:
        return torch.empty_like(x) if residual is None else (torch.empty_like(x), torch.empty_like(x))
    return None


def _silu_mul_input(self, gate_up):
    self.check_not_meta("silu_mul", gate_up)
    self.check_dtype("silu_mul", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise UnsupportedError(f"{self.name}.silu_mul: the last dim must be even ([gate | up]), got "
                               f"{tuple(gate_up.shape)}")
    if _rows(gate_up) == 0:
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    return None


def _rotary_input(self, positions, q, k, cos_sin_cache):
    self.check_not_meta("rotary", positions, q, k, cos_sin_cache)
    self.check_rotary(q, k, cos_sin_cache)
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise UnsupportedError(f"{self.name}.rotary: q must be (T, Hq, D) and k (T, Hkv, D), got q "
                               f"{tuple(q.shape)}, k {tuple(k.shape)}")
    self.check_positions(positions, q.shape[0], cos_sin_cache.shape[0])
    return (torch.empty_like(q), torch.empty_like(k)) if q.shape[0] == 0 else None


def _log_softmax_input(self, logits, temperature=1.0):
    self.check_not_meta("log_softmax", logits)
    self.check_logits(logits, temperature)
    return logits.new_empty(logits.shape, dtype=torch.float32) if logits.shape[0] == 0 else None


def _token_logprobs_input(self, logits, token_ids, temperature=1.0):
    self.check_not_meta("token_logprobs", logits, token_ids)
    self.check_logits(logits, temperature, "token_logprobs")
    self.check_token_ids(logits, token_ids)
    return logits.new_empty((0,), dtype=torch.float32) if logits.shape[0] == 0 else None


def _reduce_input(op):
    def check(self, x, dim=-1):
        self.check_not_meta(op, x)
        if x.dim() == 0:
            raise UnsupportedError(f"{self.name}.{op}: x must have at least one dim, got a scalar")
        if x.numel() == 0 and x.shape[dim] != 0:  # no rows (an empty reduced dim goes to the backend)
            return x.new_empty(x.movedim(dim, -1).shape[:-1], dtype=torch.float32)
        return None
    return check


def _topk_input(self, x, k):
    self.check_not_meta("topk", x)
    if x.dim() == 0:
        raise UnsupportedError(f"{self.name}.topk: x must have at least one dim, got a scalar")
    self.check_topk(x, k)
    if _rows(x) == 0:
        return x.new_empty((*x.shape[:-1], k)), x.new_empty((*x.shape[:-1], k), dtype=torch.int64)
    return None


def _moe_route_input(self, router_logits, routing, correction_bias=None):
    self.check_not_meta("moe_route", router_logits, correction_bias)
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise UnsupportedError(f"{self.name}.moe_route: router logits must be fp32 (T, E) (the [gemm] linear with "
                               f"out_dtype=float32), got {tuple(router_logits.shape)} {router_logits.dtype}")
    if router_logits.shape[1] != routing.num_experts:
        raise UnsupportedError(f"{self.name}.moe_route: {router_logits.shape[1]} logits per token for "
                               f"{routing.num_experts} experts")
    if correction_bias is not None and tuple(correction_bias.shape) != (routing.num_experts,):
        raise UnsupportedError(f"{self.name}.moe_route: correction_bias must be ({routing.num_experts},), got "
                               f"{tuple(correction_bias.shape)}")
    if router_logits.shape[0] == 0:
        return (router_logits.new_empty((0, routing.top_k)),
                router_logits.new_empty((0, routing.top_k), dtype=torch.int32))
    return None


def _expert_stacks(self, op, x, w13, w2) -> tuple[int, int, int]:
    """(E, 2I, H) of an expert layer's stacks, refused unless x (T, H), w13 (E, 2I, H), w2 (E, H, I) fit."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise UnsupportedError(f"{self.name}.{op}: x must be (T, H), w13 (E, 2I, H), w2 (E, H, I); got "
                               f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if e == 0 or h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise UnsupportedError(f"{self.name}.{op}: shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
                               f"(E >= 1, 2I, H), w2 {tuple(w2.shape)} (E, H, I)")
    return e, two_i, h


def _routed_slots(self, op, x, topk_weights, topk_ids, shared) -> None:
    """Refuse routing outputs (T, k) that do not belong to x (T, H), and a shared input not like x."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise UnsupportedError(f"{self.name}.{op}: topk_weights and topk_ids must both be (T={x.shape[0]}, k), got "
                               f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise UnsupportedError(f"{self.name}.{op}: topk_weights must be fp32 and topk_ids int32/int64, got "
                               f"{topk_weights.dtype} and {topk_ids.dtype}")
    if shared is not None and shared.shape != x.shape:
        raise UnsupportedError(f"{self.name}.{op}: shared must be like x {tuple(x.shape)}, got {tuple(shared.shape)}")


def _moe_experts_input(self, x, w13, w2, topk_weights, topk_ids, shared=None):
    op = "moe_experts"
    self.check_not_meta(op, x, w13, w2, topk_weights, topk_ids, shared)
    self.check_dtype(op, x, w13, w2, *([shared] if shared is not None else []))
    e, _, _ = _expert_stacks(self, op, x, w13, w2)
    _routed_slots(self, op, x, topk_weights, topk_ids, shared)
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    self.check_expert_ids(topk_ids, e)
    return None


def _fp8_moe_experts_input(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared=None):
    from hal import fp8

    op = "fp8_moe_experts"
    self.check_not_meta(op, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared)
    spec = fp8.spec_of(self.contract, f"{self.name}.{op}") if self.contract is not None else fp8.baseline_spec()
    self.check_dtype(op, x, *([shared] if shared is not None else []))
    e, two_i, h = _expert_stacks(self, op, x, w13, w2)
    fp8.check_k(h, spec, f"{self.name}.{op} (w13's K = hidden size)")
    fp8.check_k(two_i // 2, spec, f"{self.name}.{op} (w2's K = expert intermediate size)")
    for name, w, scale in (("w13", w13, w13_scale_inv), ("w2", w2, w2_scale_inv)):
        if scale.dim() != 3 or scale.shape[0] != e:
            raise UnsupportedError(f"{self.name}.{op}: {name}_scale_inv must be (E = {e}, rows/B, K/B), one block grid "
                                   f"per expert; got {tuple(scale.shape)}")
        fp8.check_weight(w[0], scale[0], w.shape[2], spec, f"{self.name}.{op} ({name} of one expert)")
    _routed_slots(self, op, x, topk_weights, topk_ids, shared)
    self.check_devices(op, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared)
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    self.check_expert_ids(topk_ids, e)
    return None


def _fp8_linear_input(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
    from hal import fp8

    op = "fp8_linear"
    self.check_not_meta(op, x, weight, weight_scale_inv, bias)
    # A contract backend needs the contract's [fp8]; the stock baseline (no contract) runs on the
    # usual 128 x 128 layout, which is all the shape checks need.
    spec = fp8.spec_of(self.contract, f"{self.name}.{op}") if self.contract is not None else fp8.baseline_spec()
    dtype = self.check_dtype(op, x)
    if x.dim() == 0:
        raise UnsupportedError(f"{self.name}.{op}: x must be (..., K), got a scalar")
    k = x.shape[-1]
    fp8.check_k(k, spec, f"{self.name}.{op}")
    fp8.check_weight(weight, weight_scale_inv, k, spec, f"{self.name}.{op}")
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype):
        raise UnsupportedError(f"{self.name}.{op}: bias must be ({n},) {dtype}, got {tuple(bias.shape)} {bias.dtype}")
    out_dtype = out_dtype or dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise UnsupportedError(f"{self.name}.{op}: out_dtype must be bfloat16 or float32, got {out_dtype}")
    self.check_devices(op, x, weight, weight_scale_inv, bias)
    if _rows(x) == 0 or n == 0:
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)
    return None


def _fp8_kv_spec(self, op, k_cache, v_cache, k_scale, v_scale):
    from hal import fp8

    spec = fp8.spec_of(self.contract, f"{self.name}.{op}")
    fp8.check_kv_cache(k_cache, v_cache, k_scale, v_scale, spec, f"{self.name}.{op}")
    return spec


def _fp8_write_kv_input(self, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    op = "fp8_write_kv"
    self.check_not_meta(op, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    _fp8_kv_spec(self, op, k_cache, v_cache, k_scale, v_scale)
    self.check_dtype(op, k, v)
    if k.dim() != 3 or v.shape != k.shape or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != (k.shape[0],):
        raise UnsupportedError(f"{self.name}.{op}: k and v must be one shape (T, Hkv, D) = (T, {k_cache.shape[2]}, "
                               f"{k_cache.shape[3]}) with one slot per token; got k {tuple(k.shape)}, v "
                               f"{tuple(v.shape)}, slots {tuple(slot_mapping.shape)}")
    self.check_devices(op, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    return _NOTHING if k.shape[0] == 0 else None


def _fp8_attention_input(self, q, k_cache, v_cache, k_scale, v_scale, meta, *, scale):
    op = "fp8_attention"
    self.check_not_meta(op, q, k_cache, v_cache, k_scale, v_scale, meta.query_start_loc, meta.seq_lens,
                        meta.block_table)
    _fp8_kv_spec(self, op, k_cache, v_cache, k_scale, v_scale)
    self.check_attention(q, k_cache, v_cache, meta, fp8_cache=True)
    self.check_head_dim(op, q.shape[-1])
    self.check_devices(op, q, k_cache, v_cache, k_scale, v_scale)
    return torch.empty_like(q) if q.shape[0] == 0 else None


_INPUT_CHECKS = {
    "linear": _linear_input, "attention": _attention_input, "write_kv": _write_kv_input,
    "rms_norm": _rms_norm_input, "silu_mul": _silu_mul_input, "rotary": _rotary_input,
    "log_softmax": _log_softmax_input, "token_logprobs": _token_logprobs_input,
    "sum": _reduce_input("sum"), "mean": _reduce_input("mean"), "topk": _topk_input,
    "moe_route": _moe_route_input, "moe_experts": _moe_experts_input, "fp8_linear": _fp8_linear_input,
    "fp8_moe_experts": _fp8_moe_experts_input,
    "fp8_write_kv": _fp8_write_kv_input, "fp8_attention": _fp8_attention_input,
}


def _checked(impl, check):
    @functools.wraps(impl)
    def op(self, *args, **kwargs):
        empty = check(self, *args, **kwargs)
        if empty is None:
            return impl(self, *args, **kwargs)
        return None if empty is _NOTHING else empty

    op._hal_checked = True
    return op


Backend.write_kv = _checked(Backend.write_kv, _write_kv_input)
