"""``--kara-trigger pressure``: a due event runs only while memory binds.

An event costs time (a recompute forward or a ring read, scoring, compaction) and, with a lossy
policy, fidelity; what it buys is free KV slots. Under ``trigger=schedule`` (the default, the
paper's periodic policy) every due event runs. Under ``trigger=pressure`` a due event runs only
when the slots it frees are needed:

    waiting requests  and  running < --max-running-requests      freed slots admit them
 or free + evictable  <  growth + fresh                          the pool would run short
       growth = sum over running requests of min(remaining_i, interval) + page_size - 1
                (what they add before the policy's next due step, ``policy.event_interval()``)
       fresh  = the event's own fresh slots (compaction allocates before it frees)

Otherwise the event is deferred (``KaraStats.deferred_events``) and the requests' windows stay
exact; a later event that finds memory binding compresses the backlog, several windows of a
request in one event, until memory no longer binds. Admission stays safe: it charges each running
request the compressed footprint of what it has still to generate, and a deferred backlog only
means the pool holds more than that now, which admission sees as less free memory.
"""

from __future__ import annotations


def memory_binds(free: int, growth: int, fresh: int, waiting: int, running: int, max_running: int) -> bool:
    """True when a due event's freed slots are needed (see the module docstring)."""
    if waiting > 0 and running < max_running:
        return True
    return free < growth + fresh


def growth_until_next_event(remaining: list[int], interval: int, page_size: int = 1) -> int:
    """Slots the running requests (``remaining`` tokens each still to generate) take before the
    next due step, ``interval`` decode steps away at most (a started page counted whole)."""
    return sum(min(max(r, 0), interval) + page_size - 1 for r in remaining)
