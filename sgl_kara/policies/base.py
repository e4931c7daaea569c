"""The policy contract: what a compression method decides, and the registry that names them.

A policy (kvpress-style: one method per file) decides where and what; the runtime does everything
else (state, scheduling, queries, compaction, admission) and knows no policy by name:

    where     ``region(row)``          which rows [start, start + length) to compress now, how
                                       many entries to keep, which queries score them (or None)
    what      ``score(inp)``           importance of each region key, per layer and KV head
              ``select(scores, keep)`` kept indices (default: the top ``keep`` by score)

When and how much (due steps, admission footprint, the capture ring's size) belong to the
policy's ``Schedule`` (schedule.py), built by the base as ``policy.schedule``: the default due at
every step and charging the whole answer, a window schedule for Kara (kara.py) and a threshold
schedule for the baselines (threshold.py). A new policy usually writes ``score`` alone and takes
the region and schedule of the policy it derives from.

Queries: a policy that scores with attention sets ``needs_queries``; its region names a query
window of logical positions and the runtime hands ``score`` that window's post-RoPE queries
(from the capture ring, ``schedule.query_capacity()`` per request, or a recompute forward).
Per-step observation (e.g. H2O's accumulated attention): set ``observes_decode`` and implement
``observe`` (called at every decode forward, per layer) and ``on_compacted`` (the request's
rows are rewritten: re-lay your per-request state the same way); per-request state lives in
``row.state.policy_state`` and is dropped when the request is retracted. ``on_compacted`` runs
before the event commits (it may fail, e.g. out of device memory, and the event is then undone):
it must build new tensors and rebind them in ``policy_state``'s dicts, never write the old ones
in place (the runtime hands it a copy of the dicts and keeps it only if the event commits).

Spread scoring: a policy whose ``score`` is ``additive`` (a sum of independent per-query terms:
scoring the query window in consecutive parts and adding the results equals scoring it whole)
and whose next region is known before it is due (``schedule.upcoming``) lets the runtime score
the window a few queries per decode step ahead of the event (``--kara-spread``), so that no
decode step carries the whole scoring.

Tokens: a policy that sets ``needs_tokens`` gets the token ids of each region in ``select``
(``tokens`` [B, M] int64, on the scores' device) and, once before any event, every token id's
text in ``bind_vocabulary`` (the model's tokenizer, each id decoded alone); the runtime reads
them from the requests' own token lists, on the host, with no device wait.

Options: each policy declares a frozen dataclass ``Options`` (its own flags, validated in its
``__post_init__`` by raising ``OptionError(field, message)``); flags are
``--kara-<prefix><field>`` where ``prefix`` is ``""`` for kara and ``"<name>_"`` for the others.
Per-request overrides (``custom_params.kara``) a policy accepts are listed in
``request_options``; a request's own values are in ``row.state.request`` (``request_option``).

Imports nothing from SGLang, config, mem_cache or scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from . import schedule


class OptionError(ValueError):
    """A policy option is invalid: ``field`` names it, the message gives the accepted range."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def need(ok: bool, field: str, message: str, value: Any) -> None:
    if not ok:
        raise OptionError(field, f"{message} (got {value!r})")


@dataclass(frozen=True)
class RowView:
    """What a policy sees of one request's row (lengths are physical rows, see ARCHITECTURE.md):

    row pos: 0 ......... P ........... f ................ L
            [ tree-owned | compressed   | uncompressed tail ]
    logical position of row p >= f = p + pos_offset
    """

    protected: int  # P
    frontier: int  # f
    length: int  # L
    pos_offset: int
    state: Any  # the request's KaraReqState (.request: its own options; .policy_state)


@dataclass(frozen=True)
class Region:
    """Rows [start, start + length) are compressed to ``keep`` entries; queries of the logical
    positions [query_start, query_start + query_len) score them (query_len 0: no queries)."""

    start: int
    length: int
    keep: int
    query_start: int = 0
    query_len: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """Requests whose regions share this are compressed in one batch."""
        return self.length, self.keep, self.query_len


@dataclass
class ScoreInput:
    """One layer of one batch of requests (all regions the same shape).

    queries   [B, query_len, H_q, D] post-RoPE, or None when the policy needs none
    k_buffer  [S, H_kv, D] this layer's key pool; slots [B, M] the region's pool slots
    layer     index of the layer among the model's attention layers (0-based)
    rows      the requests' RowViews; regions their Regions
    head_offset, model_heads
              the buffer holds the model's KV heads [head_offset, head_offset + H_kv) of
              ``model_heads`` (a tensor-parallel rank holds a slice; None: all of them)
    """

    layer: int
    queries: torch.Tensor | None
    k_buffer: torch.Tensor
    slots: torch.Tensor
    rows: list
    regions: list
    head_offset: int = 0
    model_heads: int | None = None

    def keys(self) -> torch.Tensor:
        """[B, M, H_kv, D] the region's keys."""
        return self.k_buffer[self.slots.long()]


@dataclass
class ObserveInput:
    """One layer of a decode forward: queries [T, H_q, D] of T requests, their rows' pool slots
    ``row_slots[i]`` = [L_i] (the keys each query attends to, itself included)."""

    layer: int
    queries: torch.Tensor
    k_buffer: torch.Tensor
    row_slots: list
    rows: list


class Policy(ABC):
    name: ClassVar[str]
    prefix: ClassVar[str]  # flag prefix: "" for kara, "<name>_" otherwise
    Options: ClassVar[type]
    request_options: ClassVar[tuple[str, ...]] = ()
    needs_queries: ClassVar[bool] = True
    observes_decode: ClassVar[bool] = False
    # score(q[:a]) + score(q[a:]) == score(q) over the query axis
    additive: ClassVar[bool] = False
    # select(scores, keep, tokens=...) with the regions' token ids; bind_vocabulary at start-up
    needs_tokens: ClassVar[bool] = False

    # when and how much: the schedule class, built per policy as ``self.schedule``
    Schedule: ClassVar[type[schedule.Schedule]] = schedule.Schedule

    def __init__(self, options):
        self.options = options
        self.schedule = self.Schedule(self)

    @abstractmethod
    def region(self, row: RowView) -> Region | None:
        """The rows to compress now, or None when nothing is due for this request."""

    # -- what ---------------------------------------------------------------------------------
    @abstractmethod
    def score(self, inp: ScoreInput) -> torch.Tensor:
        """[B, H_kv, M] float32 importance of each region key (higher is kept first)."""

    def select(self, scores: torch.Tensor, keep: int) -> torch.Tensor:
        """scores [B, L, H_kv, M] -> sorted kept indices [B, L, H_kv, keep] (top by score,
        ties to the lower index). A ``needs_tokens`` policy takes ``tokens`` [B, M] too."""
        return top_k(scores, keep)

    def bind_vocabulary(self, pieces: list[str]) -> None:
        """``needs_tokens``: ``pieces[i]`` is token id i's text; called once, before any
        event."""

    # -- per-step observation (observes_decode) ------------------------------------------------
    def observe(self, inp: ObserveInput) -> None:
        pass

    def on_compacted(
        self, state, start: int, region: int, kept: torch.Tensor, length: int
    ) -> None:
        """The request's rows [start, start + region) become ``kept`` ([L, H_kv, K] indices),
        its rows past the region move down by region - K; ``length`` is its row length before.
        ``state.policy_state`` is a copy of the request's dicts (tensors shared): rebind new
        tensors, never write the old ones in place; the copy is kept if the event commits."""


def request_option(state, name: str):
    """The request's own ``custom_params.kara.<name>`` (one of its policy's ``request_options``),
    or None (not given, or no request state)."""
    return None if state is None else state.request.get(name)


def top_k(scores: torch.Tensor, keep: int) -> torch.Tensor:
    m = scores.shape[-1]
    if not 0 <= keep <= m:
        raise ValueError(f"keep must be in [0, M={m}], got {keep}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :keep], dim=-1).values


# -------------------------------------------------------------------------------- registry
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available as ``--kara-policy <cls.name>``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(names())}"
        ) from None


def names() -> list[str]:
    return list(_REGISTRY)


def policies() -> list[type[Policy]]:
    return list(_REGISTRY.values())
