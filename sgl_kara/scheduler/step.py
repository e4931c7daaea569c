"""A KaraRuntime's decode step, top to bottom: called once per decode step, before SGLang's
decode memory check (``KaraRuntime.on_decode_step``).

    observe   each running request's state, device offset and capture-ring row
    plan      Planner.plan (plan.py): one snapshot of the rows, the spread parts to score and
              the event's passes (its jobs, then the catch-up's); writes nothing
    apply     the plan's openings: protected prefixes fixed, spread jobs opened
    spread    the parts scored on settled rows (events.EventRunner.advance)
    event     EventRunner.run (events.py): settle (the jobs fitted to the pool, the radix tree
              evicted for them, their settled queries scored) -> fence -> per chunk: score ->
              select -> prepare -> commit (the commit: SGLang's rows and lengths through the
              backend, then Kara's state)
    catch-up  the plan's later passes: a request still due on the rows its compression left
              (plan.py) is compressed again if the previous pass committed it; under
              trigger=pressure / headroom a pass runs only while memory binds (pressure.py)
    reopen    SGLang's admission reopened where the event freed slots

Under ``KARA_CHECK_TP_PLAN`` (tensor parallelism) the ranks agree on the plan before any work
that may enter a collective (tp_lockstep.py); step observers (diagnostics, none in production)
are told of each stage.
"""

from __future__ import annotations

import time

from sgl_kara import _sglang as adapter
from sgl_kara.scheduler.plan import apply, decoded_tokens
from sgl_kara.scheduler.pressure import DEFERRING, growth_within, horizon, memory_binds


def decode_step(rt, batch) -> None:
    """``rt``'s compression work for this decode step of ``batch``."""
    reqs = adapter.running_requests(batch)
    if not reqs:
        return
    tic = time.perf_counter()
    try:
        rt.observers.before_step(rt, batch)
        observe(rt, reqs)
        rt.decode_steps += 1
        freed = compress(rt, batch, reqs)
    finally:
        rt.observers.after_step()
    if freed:
        adapter.reopen_admission(batch)
    seconds = time.perf_counter() - tic
    rt.stats.event_max_seconds = max(rt.stats.event_max_seconds, seconds)
    if rt.plan_check is not None:
        rt.plan_check.step_state(reqs, rt.table, rt.parts.req_to_token)
        rt.plan_check.check(rt.decode_steps, "step")
        rt.stats.tp_plan_checks += 1


def observe(rt, reqs) -> None:
    """Each running request's state, statistics, device offset and ring row."""
    ring = rt.ring
    if ring is not None:
        ring.sweep({adapter.row_index(r) for r in reqs})
    for req in reqs:
        state = rt.table.state_of(req)
        row, length = adapter.row_index(req), adapter.kv_length(req)
        rt.forward.sync_offset(row, state)
        if ring is not None and (
            state.capture_from is None or not ring.holds(req, row)
        ):
            # This step's forward writes the query of logical position length + offset.
            held = ring.assign(req, row)
            state.captured_from(length + state.pos_offset if held else None)
        state.record_step(length)


def compress(rt, batch, reqs) -> int:
    """This step's plan carried out: its spread parts, then its event's passes. Returns the KV
    slots freed."""
    plan = rt.planner.plan(reqs, rt.table.state_of, rt.decode_steps)
    apply(plan, rt.observers.protected)
    if rt.plan_check is not None:
        rt.plan_check.spread(plan.chunks)
    if plan.chunks:
        lockstep(rt)
        rt.events.advance(plan.chunks)  # settled rows only (plan.plan_chunks)
    deferring = rt.cfg.trigger in DEFERRING
    if plan.passes and deferring and not binds(rt, reqs, plan.passes[0]):
        rt.stats.deferred_events += 1
        if rt.metrics is not None:
            rt.metrics.deferred.inc()
        return 0
    freed = 0
    for n, jobs in enumerate(plan.passes):
        if n:  # catch-up: the requests the previous pass committed
            jobs = [j for j in jobs if j.as_planned()]
            if not jobs or (deferring and not binds(rt, reqs, jobs)):
                break
        jobs = lockstep(rt, jobs)
        freed += rt.events.run(batch, jobs)
        rt.observers.after_event(reqs)
    return freed


def lockstep(rt, jobs=None):
    """KARA_CHECK_TP_PLAN: the ranks agree on the plan so far, and on the event's ``jobs``,
    before work that may enter a collective (tp_lockstep.py). Returns the jobs to run (step
    observers may narrow them)."""
    if jobs is not None:
        jobs = rt.observers.planned(jobs)
    if rt.plan_check is not None:
        if jobs is not None:
            jobs = rt.plan_check.planned(jobs, rt.parts.page_size)
        rt.plan_check.check(rt.decode_steps, "event")
        rt.stats.tp_plan_checks += 1
    return jobs


def binds(rt, reqs, jobs) -> bool:
    """trigger=pressure / headroom: are the slots these jobs free needed (pressure.py)?"""
    parts = rt.parts
    remaining = [
        adapter.max_new_tokens(r) - decoded_tokens(r, rt.table.state_of(r))
        for r in reqs
    ]
    growth = growth_within(
        remaining,
        horizon(rt.cfg.trigger, rt.policy.schedule.event_interval()),
        parts.page_size,
    )
    fresh = sum(j.fresh_slots(parts.page_size) for j in jobs)
    return memory_binds(
        parts.available() + parts.evictable(),
        growth,
        fresh,
        parts.waiting(),
        len(reqs),
        parts.max_running,
    )
