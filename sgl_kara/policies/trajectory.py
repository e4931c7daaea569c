"""Kara's generated KV at every decode step of a request, as a pure function of its token count.

With ``--kara-phase request`` (the default) and every event run whole at its due step (``--kara-spread
off``), a request's compressions depend on its own generated-token count only, as long as no event
is delayed (``--kara-max-seqs`` at least the requests due together, memory not binding). So the
generated rows Kara holds at each decode step follow from W, U, r, delta and R alone (alpha and gamma
choose *which* entries are kept, not how many):

    decode step s = 1, 2, ...  feeds the request's s-th output token (the first came from prefill):
        before(s)   generated rows held at step s before its event (what ``meta_info.kara`` records:
                    kv_peak_len / kv_mean_len less the prompt); before(1) = 0
        event       due when s % delta == 0, the remaining tokens (limit - s) > 1, the uncompressed
                    tail L - f >= W + R, and tail + remaining > W + R + delta (Kara leaves a request
                    that finishes within its tail charge alone); the oldest window's first W - U
                    rows become K = ceil(r (W - U)): L -= W - U - K, f += K; repeated while due (the
                    runtime's catch-up, at most ``CATCH_UP`` times)
        after(s)    the rows after the event; before(s + 1) = after(s) + 1

An answer of g tokens has g - 1 decode steps: its final generated KV is after(g - 1) + 1 and its
mean the mean of before(1..g-1) (``final`` / ``mean``, the runtime's ``kv_physical_len`` and
``kv_mean_len`` less the prompt; under SGLang's overlap scheduler the runtime also counts the
step it plans before it knows the request has ended). ``limit`` is the request's max_new_tokens (None: unbounded; the
steps before the first one Kara leaves alone are the same either way). Rows are counted from the
protected length P; with page size 1 P is the prompt, with a larger page the due steps (counted from
the prompt) fall up to a page earlier than this function has them.

Used by the threshold baselines' matched mode (``custom_params.kara.match_kara``,
policies/threshold.py): the baseline compresses, whenever its generated KV exceeds ``after(s)``,
down to exactly that, so its KV equals Kara's at every step of the same answer length. No SGLang
import, no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .kara import WindowOptions, kept_count

CATCH_UP = 8  # plan.MAX_CATCH_UP_PASSES: events one request gets in one step at most
FIELDS = ("window", "buffer", "retention", "period", "recent")


@dataclass(frozen=True)
class Schedule:
    """Kara's window settings that decide its KV counts (validated as Kara's own options)."""

    window: int
    buffer: int
    retention: float
    period: int
    recent: int = 0

    def __post_init__(self):
        WindowOptions(
            window=self.window,
            buffer=self.buffer,
            retention=self.retention,
            period=self.period,
            recent=self.recent,
        )

    @property
    def kept(self) -> int:
        return kept_count(self.window - self.buffer, self.retention)


class Trajectory:
    """before / after / tail of every decode step of one schedule and limit, computed as far as
    asked and kept (a request's steps are asked in order)."""

    def __init__(self, schedule: Schedule, limit: int | None = None):
        self.schedule = schedule
        self.limit = limit
        self._before = [0, 0]  # index s (step 0 unused)
        self._after = [0]
        self._tail = [0]  # uncompressed tail L - f after step s's event
        self._peak = [0, 0]  # max of before(1..s)
        self._length = 0  # L after the last computed step's token
        self._frontier = 0

    def _extend(self, s: int) -> None:
        o = self.schedule
        keep = o.kept
        cut = o.window - o.buffer - keep
        while len(self._after) <= s:
            step = len(self._after)
            length, frontier = self._length, self._frontier
            remaining = None if self.limit is None else self.limit - step
            if step % o.period == 0 and (remaining is None or remaining > 1):
                for _ in range(CATCH_UP):
                    tail = length - frontier
                    if tail < o.window + o.recent:
                        break
                    if (
                        remaining is not None
                        and tail + remaining <= o.window + o.recent + o.period
                    ):
                        break
                    length -= cut
                    frontier += keep
            self._after.append(length)
            self._tail.append(length - frontier)
            self._length, self._frontier = length + 1, frontier
            self._before.append(length + 1)  # before(step + 1)
            self._peak.append(max(self._peak[-1], length + 1))

    def before(self, s: int) -> int:
        """Generated rows at decode step ``s`` (>= 1) before its event."""
        if s < 1:
            raise ValueError(f"decode steps count from 1, got {s}")
        self._extend(s)
        return self._before[s]

    def after(self, s: int) -> int:
        """Generated rows at decode step ``s`` (>= 1) after its event (before its token)."""
        if s < 1:
            raise ValueError(f"decode steps count from 1, got {s}")
        self._extend(s)
        return self._after[s]

    def peak(self, s: int) -> int:
        """The most generated rows held at any decode step 1..s (before its event)."""
        if s < 1:
            return 0
        self._extend(s)
        return self._peak[s]

    def peak_kv(self, tokens: int) -> int:
        """The most generated KV an answer of ``tokens`` tokens held: over its decode steps and
        at its end (kv_peak_len - prompt)."""
        return self.peak(tokens) if tokens > 1 else 0

    def final(self, tokens: int) -> int:
        """Generated KV an answer of ``tokens`` tokens ends with (kv_physical_len - prompt)."""
        if tokens <= 1:
            return 0
        return self.after(tokens - 1) + 1

    def mean(self, tokens: int) -> float:
        """Mean generated KV over the answer's decode steps (kv_mean_len - prompt)."""
        steps = tokens - 1
        if steps < 1:
            return 0.0
        self._extend(steps)
        return sum(self._before[1 : steps + 1]) / steps


@functools.lru_cache(maxsize=256)
def trajectory(schedule: Schedule, limit: int | None = None) -> Trajectory:
    """The shared Trajectory of ``schedule`` and ``limit`` (requests with the same settings share
    one table)."""
    return Trajectory(schedule, limit)


def schedule_of(spec) -> Schedule:
    """A Schedule from ``{"window", "buffer", "retention", "period", "recent"}`` (``recent``
    optional) or a Schedule."""
    if isinstance(spec, Schedule):
        return spec
    return Schedule(**{k: spec[k] for k in FIELDS if k in spec})
