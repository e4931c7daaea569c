"""Event accounting (scheduler/events.py): an attempt whose compaction finds no fresh slots
(OutOfSlots) changes nothing and is not an event, but the time it spent scoring is compression
time all the same; a job whose fresh slots the pool cannot give is skipped before it is scored;
an event is taken a chunk of requests at a time (one recompute forward's query windows)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_kara.mem_cache.compaction import OutOfSlots
from sgl_kara.policies.base import Region
from sgl_kara.scheduler import events
from sgl_kara.scheduler.events import EventRunner
from sgl_kara.scheduler.plan import Job
from sgl_kara.scheduler.shared import KaraStats, StepShared
from sgl_kara.scheduler.staging import DeviceStaging


def _runner(compress, free=1000, recompute_tokens=8192):
    parts = SimpleNamespace(
        page_size=1,
        available=lambda: free,
        evictable=lambda: 0,
        reserve=lambda n: None,
        recompute_tokens=recompute_tokens,
        req_to_token=torch.zeros(2, 8, dtype=torch.int32),
        forward_stream=None,
    )
    rt = SimpleNamespace(stats=KaraStats(), parts=parts)
    policy = SimpleNamespace(needs_queries=False, observes_decode=False)
    shared = StepShared(policy, parts, DeviceStaging("cpu"), stats=rt.stats)
    runner = EventRunner(shared, None, None)
    runner._compress = compress
    return rt, runner


def _jobs(n, start=8, length=8, keep=2, row=40):
    """Jobs compacting rows [start, start + length) of a row of ``row`` entries to ``keep``."""
    return [
        Job(
            i,
            SimpleNamespace(kv=SimpleNamespace(kv_committed_len=row)),
            None,
            Region(start, length, keep, 0, 8),
        )
        for i in range(n)
    ]


class Clock:
    """The event runner's clock (``events.time.perf_counter``), moved only by the test."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_an_attempt_without_slots_counts_its_time_but_no_event(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(events, "time", clock)

    def no_slots(batch, group):
        clock.now += 2.5  # scoring took 2.5 s, then the allocator had nothing
        raise OutOfSlots("need 4 free KV slots for compaction")

    rt, runner = _runner(no_slots)
    runner.run(None, _jobs(3))
    assert rt.stats.events == 0 and rt.stats.requests_compressed == 0
    assert rt.stats.skipped_no_memory == 3
    assert rt.stats.compression_seconds == 2.5


def test_a_compressed_group_is_one_event_with_its_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(events, "time", clock)

    def ok(batch, group):
        clock.now += 0.75
        return len(group), 6

    rt, runner = _runner(ok)
    runner.run(None, _jobs(2))
    runner.run(None, _jobs(2))
    assert rt.stats.events == 2 and rt.stats.skipped_no_memory == 0
    assert rt.stats.compression_seconds == 1.5  # both events' time, nothing else


def test_jobs_the_pool_cannot_take_are_skipped_unscored():
    """Page size 1: compacting to K = 2 allocates 2 fresh slots per request. With 5 free slots,
    two of three requests fit; the third is skipped before any scoring (only the fitting jobs
    reach _compress), and with no free slot nothing is scored at all."""
    seen = []

    def ok(batch, group):
        seen.append([j.index for j in group])
        return len(group), 6

    rt, runner = _runner(ok, free=5)
    runner.run(None, _jobs(3))
    assert seen == [[0, 1]]
    assert (
        rt.stats.skipped_no_memory == 1
        and rt.stats.events == 1
        and rt.stats.requests_compressed == 0
    )

    seen.clear()
    rt, runner = _runner(ok, free=1)
    runner.run(None, _jobs(3))
    assert seen == [] and rt.stats.skipped_no_memory == 3 and rt.stats.events == 0


def test_paged_jobs_are_fitted_in_whole_pages():
    """Page size 16: the rewritten part of the row goes to fresh pages (fresh_slots_needed):
    region [16, 48) of a 60-entry row kept to 8 -> rows [16, 36) -> 2 pages = 32 slots."""
    from sgl_kara.mem_cache.compaction import fresh_slots_needed

    assert fresh_slots_needed(16, 60, 32, 8, 16) == 32
    seen = []
    rt, runner = _runner(lambda b, g: (seen.append(len(g)), (len(g), 24))[1], free=63)
    rt.parts.page_size = 16
    runner.run(None, _jobs(2, start=16, length=32, keep=8, row=60))
    assert seen == [1] and rt.stats.skipped_no_memory == 1


def test_an_event_is_taken_one_recompute_budget_of_windows_at_a_time():
    """Windows of 8 query tokens and a 24-token forward budget: chunks of 3 requests, in order;
    the event's scores never hold more than a chunk."""
    seen = []
    rt, runner = _runner(
        lambda b, g: (seen.append([j.index for j in g]), (len(g), 6))[1],
        recompute_tokens=24,
    )
    runner.run(None, _jobs(7))
    assert seen == [[0, 1, 2], [3, 4, 5], [6]]
    assert rt.stats.events == 1 and rt.stats.requests_compressed == 0


def test_the_slots_freed_and_the_metrics_sum_over_chunks():
    """Chunks of 3, 3 and 1 requests dropping 6 entries each: the event frees 7 x 6 = 42 slots,
    what the runner returns, the metrics count and the stats count alike."""

    class Metrics:
        def __init__(self):
            self.recorded = []
            self.seconds = SimpleNamespace(inc=lambda s: None)

        def record_event(self, requests, dropped):
            self.recorded.append((requests, dropped))

    def ok(batch, group):
        return len(group), 6

    rt, runner = _runner(ok, recompute_tokens=24)
    runner.metrics = Metrics()
    assert runner.run(None, _jobs(7)) == 42
    assert runner.metrics.recorded == [(7, 42)]
    assert rt.stats.events == 1
