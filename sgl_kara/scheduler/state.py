"""Kara's per-request state, in Kara's own table (``RequestTable``), keyed by SGLang's request
object: nothing is stored on SGLang's ``Req``.

Row layout of one request in ``req_to_token`` (docs/ARCHITECTURE.md):

    row pos: 0 ............ P ........... f .................. L
            [ tree-owned   |  compressed   | uncompressed tail        ]
              prefix slots    windows         (next window + new tokens)

    logical position of row pos p >= f  =  p + pos_offset  (kept entries below f keep the
    RoPE they were written with, so only new tokens need the offset)

Two kinds of fields: the request's own options and lifetime statistics (kept for its whole
life), and its row state (P, f, offset, compressions, capture ring position, the policy's
per-request state, the spread scoring of its upcoming window), which ``reset_row`` clears when
SGLang retracts the request and re-prefills it from its tokens (its KV is exact again).

Every change of a state is one of its methods below, named for the step that makes it (P fixed
by the plan, a spread job opened or dropped, an event's commit, a failure, a decode step seen, a
retraction): no other module assigns a field (tests/test_layering.py), so what a field can hold
is read here. The table holds a request's state while SGLang holds the request (weak keys): a finished, aborted
or dropped request leaves it with nothing to clean up. What a diagnostic keeps per
request lives in the diagnostic's own ``SideTable``, not here.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field


@dataclass
class KaraReqState:
    # -- options (custom_params.kara) and lifetime statistics: survive a retraction
    enabled: bool = True
    # the policy's per-request options (custom_params.kara fields it names in request_options)
    request: dict = field(default_factory=dict)
    kv_peak: int = 0  # largest physical KV length seen at a decode step
    kv_sum: int = 0  # physical KV lengths summed over decode steps
    kv_steps: int = 0
    tail_peak: int = 0  # largest uncompressed tail (L - f, once P is fixed) at a step
    retractions: int = 0  # times SGLang retracted the request
    # -- row state: reset by reset_row
    protected: int = -1  # P: rows [0, P) are never written or freed; -1 until fixed
    frontier: int = 0  # f: first uncompressed row (>= P once fixed)
    pos_offset: int = 0  # tokens dropped so far: logical = physical + pos_offset past f
    compressions: int = 0  # events since the row was (re)built; > 0: compressed KV
    capture_from: int | None = None  # first logical position whose query is in the ring
    offset_row: int | None = None  # the row whose device offset mirrors pos_offset
    policy_state: dict = field(default_factory=dict, repr=False)  # the policy's
    scoring: object = field(
        default=None, repr=False, compare=False
    )  # spread.ScoringJob

    ROW_FIELDS = (
        "protected",
        "frontier",
        "pos_offset",
        "compressions",
        "capture_from",
        "offset_row",
        "policy_state",
        "scoring",
    )

    # -- the transitions ---------------------------------------------------------------------
    def fix_protected(self, p: int) -> None:
        """The plan fixed P (the tree-owned prefix and the prompt): the frontier starts there."""
        assert self.protected < 0, "P fixed twice"
        self.protected = self.frontier = p

    def open_scoring(self, job):
        """The spread scoring of the upcoming window (spread.ScoringJob) starts; returns it."""
        self.scoring = job
        return job

    def drop_scoring(self) -> None:
        """Its scores are dropped (a failed part: the event scores the window whole)."""
        self.scoring = None

    def committed(self, frontier: int, dropped: int, policy_state=None) -> None:
        """An event's commit: the region became its kept rows, ending at ``frontier``; the
        ``dropped`` rows after it raised the offset; the policy's re-laid state (None: as it
        was)."""
        assert frontier >= self.frontier and dropped >= 0, (frontier, dropped)
        if policy_state is not None:
            self.policy_state = policy_state
        self.scoring = None
        self.pos_offset += dropped
        self.frontier = frontier
        self.compressions += 1

    def relaid(self, policy_state) -> KaraReqState:
        """A copy holding ``policy_state`` (a policy re-lays its state into it before the
        commit; the request's own is untouched)."""
        shadow = copy.copy(self)
        shadow.policy_state = policy_state
        return shadow

    def disable(self) -> None:
        """Never compressed again (a refused option, a failed compression)."""
        self.enabled = False
        self.scoring = None

    def captured_from(self, position: int | None) -> None:
        """The first logical position whose query the capture ring holds (None: none)."""
        self.capture_from = position

    def mirrored_at(self, row: int) -> None:
        """The device offset of ``row`` now mirrors ``pos_offset``."""
        self.offset_row = row

    def reset_row(self) -> None:
        """The request was retracted: it will be re-prefilled from its tokens, uncompressed."""
        self.retractions += 1
        fresh = KaraReqState()
        for name in self.ROW_FIELDS:
            setattr(self, name, getattr(fresh, name))

    def record_step(self, length: int) -> None:
        """Statistics of one decode step at physical length ``length``."""
        self.kv_peak = max(self.kv_peak, length)
        if self.protected >= 0:
            self.tail_peak = max(self.tail_peak, length - self.frontier)
        self.kv_sum += length
        self.kv_steps += 1

    def meta(self, physical_len: int) -> dict:
        return {
            "compressions": self.compressions,
            "kv_physical_len": physical_len,
            "kv_logical_len": physical_len + self.pos_offset,
            "kv_peak_len": max(self.kv_peak, physical_len),
            "kv_mean_len": self.kv_sum / self.kv_steps
            if self.kv_steps
            else float(physical_len),
            "kv_tail_peak": self.tail_peak,
            "enabled": self.enabled,
        }


class RequestTable:
    """Kara's state of every request this scheduler has seen and SGLang still holds."""

    def __init__(self, policy=None):
        self.policy = policy  # the served policy (``state_of``)
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # request id -> state, for what sees a forward batch's ids only (an attention observer)
        self._by_rid: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def get(self, req) -> KaraReqState | None:
        return self._states.get(req)

    def state_of(self, req) -> KaraReqState:
        """The request's state, created when first seen from its ``custom_params.kara``: a
        request option the served policy does not take, or a sampling mode it cannot serve,
        disables compression for it and aborts it with a 400 (also checked in the tokenizer:
        plugin)."""
        state = self.get(req)
        if state is not None:
            return state
        from sgl_kara import _sglang as adapter
        from sgl_kara.policies import base as policy_base
        from sgl_kara.request_options import PER_REQUEST, check_supported, validate

        opts = validate(adapter.custom_params(req))
        request = {k: opts[k] for k in PER_REQUEST if opts.get(k) is not None}
        state = self.add(
            req, KaraReqState(enabled=opts.get("enable", True), request=request)
        )
        served = self.policy.name
        for name in request:
            if name not in self.policy.request_options:
                takers = [
                    p.name for p in policy_base.policies() if name in p.request_options
                ]
                state.disable()
                adapter.abort(
                    req,
                    f"custom_params.kara.{name} applies to --kara-policy "
                    f"{'/'.join(takers)}, not {served}",
                    400,
                )
        try:
            check_supported(adapter.sampling_params(req), served)
        except ValueError as e:
            state.disable()
            adapter.abort(req, str(e), 400)
        return state

    def by_rid(self, rid) -> KaraReqState | None:
        return self._by_rid.get(rid)

    def add(self, req, state: KaraReqState) -> KaraReqState:
        from sgl_kara import _sglang as adapter

        self._states[req] = state
        self._by_rid[adapter.rid(req)] = state
        return state

    def __len__(self) -> int:
        return len(self._states)


class SideTable:
    """One component's own data per request, kept outside ``KaraReqState`` (a
    diagnostic's: the integrity check's prefix snapshots, the eviction record's logical
    rows). Keyed by the request's state, by identity, and dropped with it. ``row``: the
    data describes the request's row, so a retraction clears it, as ``reset_row`` clears
    the state's own row fields (the state's retraction count is stored with it)."""

    def __init__(self, row: bool = False):
        self.row = row
        self._data: dict[int, tuple[int, object]] = {}

    def get(self, state, default=None):
        got = self._data.get(id(state))
        if got is None or (self.row and got[0] != state.retractions):
            return default
        return got[1]

    def set(self, state, value) -> None:
        key = id(state)
        if key not in self._data:  # dropped with the state (weakly held: no cycle)
            weakref.finalize(state, self._data.pop, key, None)
        self._data[key] = (state.retractions, value)
