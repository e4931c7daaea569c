"""Event accounting (scheduler/events.py): an attempt whose compaction finds no fresh slots
(OutOfSlots) changes nothing and is not an event, but the time it spent scoring is compression
time all the same (the throughput grid's compress share undercounted it before session 8)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from sgl_kara.mem_cache.compaction import OutOfSlots
from sgl_kara.scheduler.events import EventRunner
from sgl_kara.scheduler.runtime import KaraStats


def _runner(compress):
    rt = SimpleNamespace(stats=KaraStats(), metrics=None,
                         req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32)),
                         allocator=SimpleNamespace(available_size=lambda: 0))
    runner = EventRunner(rt)
    runner._compress_group = compress
    return rt, runner


def _jobs(n):
    return [SimpleNamespace(region=SimpleNamespace(shape=(8, 2, 8))) for _ in range(n)]


def test_an_attempt_without_slots_counts_its_time_but_no_event():
    def no_slots(batch, group):
        time.sleep(0.02)  # scoring ran, then the allocator had nothing
        raise OutOfSlots("need 4 free KV slots for compaction")

    rt, runner = _runner(no_slots)
    runner.run(None, _jobs(3))
    assert rt.stats.events == 0 and rt.stats.requests_compressed == 0
    assert rt.stats.skipped_no_memory == 3
    assert rt.stats.compression_seconds >= 0.02


def test_a_compressed_group_is_one_event_with_its_time():
    def ok(batch, group):
        time.sleep(0.01)
        return len(group), 6

    rt, runner = _runner(ok)
    runner.run(None, _jobs(2))
    assert rt.stats.events == 1 and rt.stats.skipped_no_memory == 0
    assert rt.stats.compression_seconds >= 0.01
