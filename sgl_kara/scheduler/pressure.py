"""``--kara-trigger pressure`` and ``headroom``: a due event runs only while memory binds.

An event costs time (a recompute forward or a ring read, scoring, compaction) and, with a lossy
policy, fidelity; what it buys is free KV slots. Under ``trigger=schedule`` (the default, the
paper's periodic policy) every due event runs. Under the two other triggers a due event runs only
when the slots it frees are needed:

    waiting requests  and  running < --max-running-requests      freed slots admit them
 or free + evictable  <  growth + fresh                          the pool would run short
       growth = sum over running requests of min(remaining_i, horizon) + page_size - 1
       fresh  = the event's own fresh slots (compaction allocates before it frees)

They differ in the horizon, how far ahead "would run short" looks:

    pressure   horizon = ``schedule.event_interval()``: what the running requests add before the
               policy's next due step. Events wait until the pool is nearly full, so rows stay
               long (uncompressed) for most of a memory-bound run.
    headroom   horizon = everything they may still generate (``max_new_tokens - len(output)``).
               Where memory binds at all, every due event runs, as under the schedule; events
               are skipped only where the pool could hold every running request to its end
               uncompressed and nobody waits -- there the freed slots have no use (the tail of
               a run, a lightly loaded server).

Otherwise the event is deferred (``KaraStats.deferred_events``) and the requests' windows stay
exact; a later event that finds memory binding compresses the backlog, several windows of a
request in one event, until memory no longer binds. Admission stays safe: it charges each running
request the compressed footprint of what it has still to generate, and a deferred backlog only
means the pool holds more than that now, which admission sees as less free memory.
"""

from __future__ import annotations


def memory_binds(
    free: int, growth: int, fresh: int, waiting: int, running: int, max_running: int
) -> bool:
    """True when a due event's freed slots are needed (see the module docstring)."""
    if waiting > 0 and running < max_running:
        return True
    return free < growth + fresh


# the triggers that defer events (config.TRIGGERS less the schedule); each looks this far ahead
DEFERRING = ("pressure", "headroom")


def growth_within(remaining: list[int], horizon: int | None, page_size: int = 1) -> int:
    """Slots the running requests (``remaining`` tokens each still to generate) take within the
    next ``horizon`` decode steps (None: to their end), a started page counted whole."""
    ahead = [max(r, 0) for r in remaining]
    return sum(
        (r if horizon is None else min(r, horizon)) + page_size - 1 for r in ahead
    )


def horizon(trigger: str, event_interval: int) -> int | None:
    """Decode steps ahead a deferring trigger checks the pool for: pressure up to the policy's next
    due step, headroom to the requests' end (None). Only the triggers in ``DEFERRING`` have one."""
    return {"pressure": event_interval, "headroom": None}[trigger]
