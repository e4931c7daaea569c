"""Kara: sliding-window bidirectional-attention scoring + Token2Chunk selection.

Idea
    Compress only the trailing window of |W| freshly decoded tokens. Every query in
    the window attends (no causal mask) to the keys of the compressible region
    W \\ U (the window minus a protected buffer U of the newest |U| tokens); the
    attention each key receives, summed over the queries, is its importance A
    (Eq. 4). The top ceil(r*M) - alpha keys are kept as discrete candidates I
    (Eq. 5). Token2Chunk then treats every two consecutive kept indices as the
    end points of a candidate chunk, keeps the chunks shorter than gamma, ranks
    them by R_k = (A[I[k]] + A[I[k+1]]) * (I[k+1] - I[k] - 1) (Eq. 6), adds the
    interiors of the top floor(alpha / (gamma - 2)) chunks (Eq. 7-8), and fills
    whatever is left of the budget with the best-scored positions not yet kept
    (App. C.3), so exactly K = ceil(r*M) positions survive.

Paper
    "Kara" (sliding-window KV cache compression for reasoning models, with
    KvLLM), Section 4.1-4.2, Eq. 4-8, App. C.2-C.3.

Parameters (flags --kara-<name>; defaults: the paper's App. B.1 / B.3)
    window (W)         tokens per compression window (512)
    buffer (U)         last tokens of a window never compressed (32)
    retention (r)      fraction of the compressible region kept, in (0, 1] (0.25)
    chunk_budget (alpha) positions reserved for Token2Chunk; 0 disables it; unset:
                       min(16, floor(K/2)) with K = ceil(r (W - U)), valid for any W, U, r
    max_chunk (gamma)  maximum chunk length including both end points, >= 3 (8);
                       a chunk between kept indices i < j qualifies iff
                       1 < j - i < gamma (so it adds j - i - 1 <= gamma - 2).
    scoring            bidirectional (all W window queries) | buffer (the last U only,
                       the paper's ablation; its region names only those U queries, so a
                       recompute forward computes U tokens per window instead of W)
    period (delta)     decode steps between compression events (128)
    recent (R)         recency band: a window [f, f + W) is compressed only once R newer
                       tokens exist, so the last R + W tokens stay exact (0: the paper)

Tie-breaking everywhere: higher score first, then lower index (stable sorts).
Scores are assumed finite. Nothing here syncs with the host, so `select` can run
on GPU tensors inside the server step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels.window_score import window_scores, window_scores_paged  # noqa: F401  (window_scores: Eq. 4 reference)
from .base import Policy, Region, RowView, ScoreInput, need, register, request_option
from .schedule import Schedule

PAPER_CHUNK_BUDGET = 16
SCORINGS = ("bidirectional", "buffer")


def kept_count(m: int, retention: float) -> int:
    """K = ceil(retention * m), robust to float error (0.3 * 100 -> 30); >= 1 if m >= 1."""
    if not 0.0 < retention <= 1.0:
        raise ValueError(f"retention must be in (0, 1], got {retention}")
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    if m == 0:
        return 0
    return max(1, min(m, math.ceil(round(retention * m, 6))))


def _check_select_args(
    m: int, retention: float, chunk_budget: int, max_chunk: int
) -> int:
    k = kept_count(m, retention)
    if max_chunk < 3:
        raise ValueError(f"max_chunk (gamma) must be >= 3, got {max_chunk}")
    if chunk_budget < 0:
        raise ValueError(f"chunk_budget must be >= 0, got {chunk_budget}")
    if chunk_budget > 0 and chunk_budget >= k:
        raise ValueError(
            f"chunk_budget ({chunk_budget}) must be < kept count K={k} "
            f"(M={m}, retention={retention})"
        )
    return k


def select(
    scores: torch.Tensor, retention: float, chunk_budget: int, max_chunk: int
) -> torch.Tensor:
    """Kara selection (Eq. 5-8 + App. C.3), vectorised over all leading dims.

    scores: [..., M] importance A (any float dtype; assumed finite).
    Returns sorted kept indices, int64 [..., K] with K = kept_count(M, retention),
    the same K for every row. chunk_budget == 0 is plain TopK(K).
    """
    *lead, m = scores.shape
    k = _check_select_args(m, retention, chunk_budget, max_chunk)
    dev = scores.device
    a = scores.reshape(-1, m)
    n = a.shape[0]
    if k == m:
        return torch.arange(m, device=dev).expand(*lead, m).contiguous()
    # Ranking by score: descending, ties -> lower index (stable sort).
    order = torch.sort(a, dim=1, descending=True, stable=True).indices  # [N, M]
    if chunk_budget == 0:
        return torch.sort(order[:, :k], dim=1).values.reshape(*lead, k)

    # kept has a dump column at index M that absorbs masked-out scatters.
    kept = torch.zeros(n, m + 1, dtype=torch.bool, device=dev)
    k0 = k - chunk_budget
    idx = torch.sort(order[:, :k0], dim=1).values  # (a)+(b): I, ascending [N, K0]
    kept.scatter_(1, idx, True)

    n_chunks = min(chunk_budget // (max_chunk - 2), k0 - 1)
    if n_chunks > 0:
        #   I[k]   I[k]+1 ... I[k+1]-1   I[k+1]
        #    ^     '--- interior ---'      ^       gap = I[k+1] - I[k]
        left, right = idx[:, :-1], idx[:, 1:]  # [N, K0-1]
        gap = right - left
        cand = (gap > 1) & (gap < max_chunk)
        a64 = a.double()
        r = (a64.gather(1, left) + a64.gather(1, right)) * (gap - 1).double()  # Eq. 6
        # Rank chunks: candidates first, then higher R, then lower k (two stable sorts).
        by_r = torch.sort(r, dim=1, descending=True, stable=True).indices
        by_c = torch.sort(
            cand.gather(1, by_r).int(), dim=1, descending=True, stable=True
        ).indices
        top = by_r.gather(1, by_c)[:, :n_chunks]  # [N, n_chunks] chunk ids, Eq. 7
        top_ok = cand.gather(1, top)
        top_left, top_gap = left.gather(1, top), gap.gather(1, top)
        off = torch.arange(1, max_chunk - 1, device=dev)  # interior offsets 1..gamma-2
        pos = top_left[..., None] + off  # [N, n_chunks, gamma-2]
        ok = top_ok[..., None] & (off < top_gap[..., None])
        kept.scatter_(1, torch.where(ok, pos, m).reshape(n, -1), True)  # Eq. 8

    # (c) fill the rest of the budget with the best-scored positions not yet kept.
    body = kept[:, :m]
    free = ~body.gather(1, order)  # [N, M] in score order
    need = k - body.sum(dim=1, keepdim=True)
    take = free & (torch.cumsum(free.int(), dim=1) <= need)
    kept.scatter_(1, torch.where(take, order, m), True)
    out = torch.sort((~kept[:, :m]).int(), dim=1, stable=True).indices[:, :k]
    return out.reshape(*lead, k)


def select_ref(
    scores_1d: torch.Tensor, retention: float, chunk_budget: int, max_chunk: int
) -> list[int]:
    """Plain-Python Kara selection for one row [M], written straight from the paper."""
    a = [float(x) for x in scores_1d.reshape(-1).tolist()]
    m = len(a)
    k = _check_select_args(m, retention, chunk_budget, max_chunk)
    order = sorted(range(m), key=lambda j: (-a[j], j))
    ids = sorted(order[: k - chunk_budget])  # Eq. 5, ascending
    if chunk_budget == 0:
        return ids
    chunks = []
    for c in range(len(ids) - 1):
        gap = ids[c + 1] - ids[c]
        if 1 < gap < max_chunk:  # Eq. 7 constraint; gap 1 has no interior
            chunks.append(((a[ids[c]] + a[ids[c + 1]]) * (gap - 1), c))  # Eq. 6
    chunks.sort(key=lambda rc: (-rc[0], rc[1]))
    kept = set(ids)
    for _, c in chunks[: chunk_budget // (max_chunk - 2)]:
        kept.update(range(ids[c] + 1, ids[c + 1]))  # Eq. 8
    for j in order:  # App. C.3 budget fill
        if len(kept) >= k:
            break
        kept.add(j)
    return sorted(kept)


def default_chunk_budget(kept: int) -> int:
    """alpha when unset: the paper's 16 (App. B.3) where a window keeps K >= 32 entries, else
    floor(K/2), so TopK always keeps at least half of the K entries (valid for every W, U, r)."""
    return min(PAPER_CHUNK_BUDGET, kept // 2)


@dataclass(frozen=True)
class WindowOptions:
    """Kara's window schedule, shared by the policies built on its windows (Kara, random):
    W, U, r, delta and the recency band R, with their checks."""

    window: int = field(
        default=512,
        metadata={
            "help": "W: tokens per compression window (the paper's accuracy runs: 256-512)"
        },
    )
    buffer: int = field(
        default=32,
        metadata={
            "help": "U: last tokens of a window never compressed (the paper: 32 or 64)"
        },
    )
    retention: float = field(
        default=0.25,
        metadata={
            "help": "r: fraction of the W-U compressible tokens kept, in (0, 1] (the paper: 0.2-0.6)"
        },
    )
    period: int = field(
        default=128,
        metadata={
            "help": "delta: a request is due every delta of its own decode steps (--kara-phase server: the scheduler's, as the paper's 128)"
        },
    )
    recent: int = field(
        default=0,
        metadata={
            "help": "R: a window is compressed only once R newer tokens exist, so the last R + W stay exact (0: the paper)"
        },
    )

    def __post_init__(self):
        need(
            2 <= self.window <= 65536,
            "window",
            "must be an integer in [2, 65536]",
            self.window,
        )
        need(
            0 <= self.buffer < self.window,
            "buffer",
            f"must be in [0, window={self.window}) (W > U)",
            self.buffer,
        )
        need(
            0.0 < self.retention <= 1.0 and math.isfinite(self.retention),
            "retention",
            "must be in (0, 1]",
            self.retention,
        )
        need(
            1 <= self.period <= 1_000_000,
            "period",
            "must be an integer in [1, 1000000]",
            self.period,
        )
        need(
            0 <= self.recent <= 1_000_000,
            "recent",
            "must be an integer in [0, 1000000]",
            self.recent,
        )

    @property
    def compressible(self) -> int:
        """W - U: window rows that compression may drop."""
        return self.window - self.buffer

    @property
    def kept_per_window(self) -> int:
        return kept_count(self.window - self.buffer, self.retention)


@dataclass(frozen=True)
class KaraOptions(WindowOptions):
    chunk_budget: int | None = field(
        default=None,
        metadata={
            "help": "alpha: entries Token2Chunk may add (0 disables it; the paper: 16 or 32); unset: min(16, floor(K/2)), K = ceil(r(W-U))"
        },
    )
    max_chunk: int = field(
        default=8,
        metadata={
            "help": "gamma: max chunk length including both endpoints, >= 3 (the paper: 8)"
        },
    )
    scoring: str = field(
        default="bidirectional",
        metadata={
            "help": f"window scoring: {SCORINGS} ('buffer' = last U queries only, the paper's ablation)"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            self.scoring in SCORINGS,
            "scoring",
            f"must be one of {', '.join(SCORINGS)}",
            self.scoring,
        )
        need(
            self.scoring != "buffer" or self.buffer > 0,
            "buffer",
            "must be > 0 with --kara-scoring buffer",
            self.buffer,
        )
        need(
            3 <= self.max_chunk <= 65536,
            "max_chunk",
            "must be an integer in [3, 65536]",
            self.max_chunk,
        )
        k = self.kept_per_window
        if self.chunk_budget is None:
            object.__setattr__(self, "chunk_budget", default_chunk_budget(k))
        need(self.chunk_budget >= 0, "chunk_budget", "must be >= 0", self.chunk_budget)
        need(
            self.chunk_budget < k,
            "chunk_budget",
            f"must be in [0, ceil(retention*(window-buffer))={k}) so TopK keeps at least one entry",
            self.chunk_budget,
        )


def request_retention(options: WindowOptions, state) -> float:
    """The request's own retention (``custom_params.kara.retention``), or the options'."""
    r = request_option(state, "retention")
    return options.retention if r is None else r


def _rate(options: WindowOptions, state) -> float:
    """Kept share of a window's compressible rows."""
    return (
        kept_count(options.compressible, request_retention(options, state))
        / options.compressible
    )


class KaraSchedule(Schedule):
    """Every ``period`` steps; a request's uncompressed tail is at most a window, the recency
    band and the tokens decoded while waiting for the next event (W + R + period)."""

    def due(self, step: int) -> bool:
        return step % self.options.period == 0

    def next_due(self, step: int) -> int:
        return -(-step // self.options.period) * self.options.period

    def event_interval(self) -> int:
        return self.options.period

    def upcoming(self, row: RowView) -> tuple[Region, int] | None:
        """The oldest uncompressed window once its W - U compressible keys are all decoded: at
        most U + R steps before ``region`` names it (the buffer's queries are still to come)."""
        o = self.options
        tail = row.length - row.frontier
        if tail < o.compressible:
            return None
        return self.policy.window_region(row), max(0, o.window + o.recent - tail)

    def worth_compressing(self, row: RowView, remaining: int) -> bool:
        """A request whose uncompressed tail stays within W + period until it finishes is left
        alone: admission (``footprint``) charged it that tail, and the event would score a whole
        window to free slots for fewer than ``period`` more steps."""
        o = self.options
        return (
            remaining > 1
            and (row.length - row.frontier) + remaining > o.window + o.recent + o.period
        )

    def footprint(self, remaining: int, state) -> int:
        """Each window of W - U new tokens shrinks to K entries; the uncompressed tail is at most
        a window, the recency band and the tokens decoded while waiting for the next event."""
        if remaining <= 0:
            return remaining
        o = self.options
        return min(
            remaining,
            math.ceil(remaining * _rate(o, state)) + o.window + o.recent + o.period,
        )

    def growth(self, remaining: int, row: RowView) -> int:
        """A running request already holds its uncompressed tail t (at most W + R + period): by
        the time it has generated G more, at least t + G - (W + R + period) of its tail rows were
        compressed to ``rate`` of themselves, so its KV grew by at most
        G rate + (W + R + period - t)(1 - rate), and by at most G."""
        if remaining <= 0:
            return remaining
        o = self.options
        rate = _rate(o, row.state)
        start = row.frontier if row.protected >= 0 else row.length
        tail = max(0, row.length - start)
        allowance = max(0, o.window + o.recent + o.period - tail)
        return min(remaining, math.ceil(remaining * rate + allowance * (1 - rate)))

    def tail_charge(self, row: RowView) -> int:
        """``footprint`` charged a window, the recency band and the steps to the next event."""
        o = self.options
        return o.window + o.recent + o.period

    def query_capacity(self) -> int:
        # A window becomes due at most `period` steps before its event, and is scored only once
        # `recent` newer tokens follow it: the ring must still hold its oldest query then.
        if not self.policy.needs_queries:
            return 0
        return self.options.window + self.options.period + self.options.recent


@register
class KaraPolicy(Policy):
    """Periodic: every ``period`` decode steps, each request whose oldest uncompressed window
    [f, f + W) is complete (and followed by ``recent`` newer rows) has its first W - U rows
    compressed to K (the last U stay, and start the next window)."""

    name = "kara"
    prefix = ""
    Options = KaraOptions
    Schedule = KaraSchedule
    request_options = ("retention",)
    additive = True  # Eq. 4: a softmax per query, summed over the queries

    def region(self, row: RowView) -> Region | None:
        o = self.options
        if row.length - row.frontier < o.window + o.recent:
            return None
        return self.window_region(row)

    def window_region(self, row: RowView) -> Region:
        """The oldest uncompressed window's W - U rows, whether or not it is due yet."""
        o = self.options
        m = o.compressible
        # buffer scoring: only the last U queries score, so a recompute forward computes those alone
        q_start, q_len = (
            (row.frontier + m, o.buffer)
            if o.scoring == "buffer"
            else (row.frontier, o.window)
        )
        keep = kept_count(m, request_retention(o, row.state))
        return Region(row.frontier, m, keep, q_start, q_len)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        # q: the region's query window (region()): all W queries, or the last U with scoring=buffer.
        return window_scores_paged(inp.queries.contiguous(), inp.k_buffer, inp.slots)

    def select(self, scores: torch.Tensor, keep: int) -> torch.Tensor:
        m = scores.shape[-1]
        # keep / m reproduces keep through kept_count (per-request retention too); a request
        # keeping fewer than the chunk budget needs gets alpha = keep - 1.
        return select(
            scores,
            keep / m,
            min(self.options.chunk_budget, keep - 1),
            self.options.max_chunk,
        )
