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
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from hal.contract import Contract
from hal.errors import ContractMismatchError, UnsupportedError


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
    #: names of the contracts this backend realises (empty: no invariance claims, e.g. the baseline)
    contracts: ClassVar[tuple[str, ...]] = ()
    #: activation dtypes it realises them for
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float32)
    #: (op, dtype) combinations it declares missing, as data, e.g. (("attention", torch.float32),); the
    #: conformance kit does not test them and reports them as unsupported instead of failing them
    unsupported: ClassVar[tuple[tuple[str, torch.dtype], ...]] = ()

    def __init__(self, contract: Contract | None, device: torch.device | str | None = None):
        if contract is not None and contract.name not in self.contracts:
            raise ContractMismatchError(
                f"backend {self.name!r} does not realise contract {contract.name!r}; it realises: "
                f"{', '.join(self.contracts) or 'no contract (it is a non-conforming baseline)'}")
        self.contract = contract
        self.device = torch.device(device) if device is not None else self.default_device()

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
        return dtype

    def check_devices(self, op: str, *tensors: torch.Tensor | None) -> None:
        """Raise unless every given tensor lives on this backend's device type."""
        for t in tensors:
            if t is not None and t.device.type != self.device.type:
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
        if cos_sin_cache.dtype != torch.float32 or rot % 2 or rot > q.shape[-1]:
            raise UnsupportedError(f"{self.name}.rotary: cos_sin_cache must be fp32 (max_pos, R) with even R <= head "
                                   f"dim, got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
        return dtype

    def check_topk(self, x: torch.Tensor, k: int) -> None:
        if not 0 < k <= x.shape[-1]:
            raise UnsupportedError(f"{self.name}.topk: k must be in 1..{x.shape[-1]}, got {k}")

    def check_logits(self, logits: torch.Tensor, temperature: float) -> None:
        if logits.dim() != 2:
            raise UnsupportedError(f"{self.name}.log_softmax: logits must be (M, V), got {tuple(logits.shape)}")
        if not temperature > 0:
            raise UnsupportedError(f"{self.name}.log_softmax: temperature must be > 0, got {temperature}")

    def __repr__(self) -> str:
        bound = str(self.contract) if self.contract is not None else "no contract"
        return f"<{type(self).__name__} {self.name!r} on {self.device} realising {bound}>"

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
        self.check_dtype("write_kv", k, v, k_cache, v_cache)
        if slot_mapping.shape[0] != k.shape[0]:
            raise UnsupportedError(f"{self.name}.write_kv: {k.shape[0]} tokens but {slot_mapping.shape[0]} slots")
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
