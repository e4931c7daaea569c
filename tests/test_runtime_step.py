"""The runtime's glue around an event, without an engine: freed slots reopen SGLang's admission;
under the overlap scheduler on CUDA, event work that rewrites rows is ordered after the in-flight
forward (the fence), and scoring of settled rows runs before it; a step scores its spread parts
before it plans its event; an event reads no device tensor back to the host for what it already
knows."""

from __future__ import annotations

import types

import torch

from sgl_kara.mem_cache.compaction import CompactionPlan, prepare_compaction
from sgl_kara.scheduler import runtime as runtime_mod
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.runtime import KaraRuntime
from sgl_kara.scheduler.shared import KaraStats


def bare_runtime(freed: int, calls: list):
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.stats, rt.decode_steps, rt.ring = KaraStats(), 0, None
    rt.observers = Observers()
    rt._observe = lambda reqs: calls.append("observe")

    def step(batch, reqs):
        calls.append("step")
        return freed

    rt._step = step
    return rt


def batch(full: bool):
    return types.SimpleNamespace(reqs=[object()], batch_is_full=full)


def test_an_event_that_frees_slots_reopens_admission():
    """SGLang's prefill skips admission while ``running_batch.batch_is_full`` (scheduler.py
    get_new_batch_prefill) and clears it only when a request leaves: an event's freed slots
    must clear it too, or waiting requests wait for the next finished request."""
    b = batch(full=True)
    bare_runtime(freed=40, calls=[]).on_decode_step(b)
    assert b.batch_is_full is False
    b = batch(full=True)
    bare_runtime(freed=0, calls=[]).on_decode_step(b)
    assert b.batch_is_full is True  # nothing freed: SGLang's own judgement stands


class Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


def test_event_work_waits_for_the_overlapped_forward_on_cuda(monkeypatch):
    log = []
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.observers = Observers()
    rt.parts = types.SimpleNamespace(forward_stream=Stream("forward", log))
    schedule = Stream("schedule", log)
    monkeypatch.setattr(runtime_mod.torch.cuda, "current_stream", lambda: schedule)
    rt._fence()
    assert log == ["schedule waits forward"]
    rt.parts.forward_stream = None  # CPU, or no overlap: nothing to order
    rt._fence()
    assert log == ["schedule waits forward"]


def test_the_runtime_fences_before_any_event_rewrite():
    """_step: the spread parts (settled rows only) are scored before the fence; the event is
    planned after them (a part may complete a due window) and handed the fence, which it calls
    once its settled work is done and before anything that rewrites rows."""
    order = []
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.cfg = types.SimpleNamespace(trigger="schedule")
    rt.decode_steps, rt.stats = 1, KaraStats()
    rt.observers, rt.plan_check = Observers(), None
    rt._fence = lambda: order.append("fence")

    def run(batch, jobs, fence, settled):
        order.append("settle")
        fence()
        order.append("commit")
        return 0

    rt.events = types.SimpleNamespace(
        advance=lambda c: order.append("advance"), run=run
    )
    job = types.SimpleNamespace(req=object())
    rt.planner = types.SimpleNamespace(
        chunks=lambda reqs, state_of, step: order.append("chunks") or [("job", 1)],
        jobs=lambda reqs, state_of, step: order.append("jobs") or [job],
        again=lambda reqs, state_of, step, done: [],
        settled=lambda job: 0,
    )
    rt._step(types.SimpleNamespace(reqs=[]), [])
    assert order == ["chunks", "advance", "jobs", "settle", "fence", "commit"]


class DeviceLike(torch.Tensor):
    """A tensor standing for one on the device: reading it on the host would sync."""

    reads = []

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if func in (
            torch.Tensor.tolist,
            torch.Tensor.item,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
        ):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types_, args, kwargs or {})


def test_compaction_reads_no_row_index_back_to_the_host():
    L, H, D, S = 2, 2, 4, 64
    k = [torch.randn(S, H, D) for _ in range(L)]
    v = [torch.randn(S, H, D) for _ in range(L)]
    req_to_token = torch.zeros(3, 32, dtype=torch.int32)
    req_to_token[1, :20] = torch.arange(1, 21)
    req_to_token[2, :20] = torch.arange(21, 41)
    free = list(range(41, S))
    kept = torch.sort(torch.rand(2, L, H, 8).argsort(-1)[..., :3], -1).values
    rows = torch.tensor([1, 2]).as_subclass(DeviceLike)
    plan = CompactionPlan(
        rows=rows, starts=[4, 4], lengths=[20, 20], region=8, kept=kept, row_ids=[1, 2]
    )
    DeviceLike.reads = []
    prepared = prepare_compaction(
        plan,
        req_to_token,
        k,
        v,
        lambda n: torch.tensor([free.pop() for _ in range(n)]),
        lambda s: None,
        1,
    )
    prepared.commit(req_to_token, lambda s: None)
    assert DeviceLike.reads == [], DeviceLike.reads
    assert req_to_token[1, :15].unique().numel() == 15  # rewritten: 4 + 3 kept + 8 tail
