"""The runtime's glue around an event, without an engine: freed slots reopen SGLang's admission;
under the overlap scheduler on CUDA, event work that rewrites rows is ordered after the in-flight
forward (the fence), and scoring of settled rows runs before it; a step plans once, scores its
spread parts, then runs its event; an event reads no device tensor back to the host for what it
already knows."""

from __future__ import annotations

import types

import torch

from sgl_kara.mem_cache.compaction import CompactionPlan, prepare_compaction
from sgl_kara.scheduler import events as events_mod
from sgl_kara.scheduler import step as step_mod
from sgl_kara.scheduler.events import EventRunner
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.plan import StepPlan
from sgl_kara.scheduler.runtime import KaraRuntime
from sgl_kara.scheduler.shared import KaraStats


def bare_runtime(freed: int, calls: list, monkeypatch):
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.stats, rt.decode_steps, rt.ring, rt.plan_check = KaraStats(), 0, None, None
    rt.observers = Observers()
    monkeypatch.setattr(step_mod, "observe", lambda rt, reqs: calls.append("observe"))

    def compress(rt, batch, reqs):
        calls.append("step")
        return freed

    monkeypatch.setattr(step_mod, "compress", compress)
    return rt


def batch(full: bool):
    return types.SimpleNamespace(reqs=[object()], batch_is_full=full)


def test_an_event_that_frees_slots_reopens_admission(monkeypatch):
    """SGLang's prefill skips admission while ``running_batch.batch_is_full`` (scheduler.py
    get_new_batch_prefill) and clears it only when a request leaves: an event's freed slots
    must clear it too, or waiting requests wait for the next finished request."""
    b = batch(full=True)
    calls = []
    bare_runtime(freed=40, calls=calls, monkeypatch=monkeypatch).on_decode_step(b)
    assert b.batch_is_full is False and calls == ["observe", "step"]
    b = batch(full=True)
    bare_runtime(freed=0, calls=[], monkeypatch=monkeypatch).on_decode_step(b)
    assert b.batch_is_full is True  # nothing freed: SGLang's own judgement stands


class Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


def test_event_work_waits_for_the_overlapped_forward_on_cuda(monkeypatch):
    log = []
    runner = EventRunner.__new__(EventRunner)
    runner.observers = Observers()
    runner.parts = types.SimpleNamespace(forward_stream=Stream("forward", log))
    schedule = Stream("schedule", log)
    monkeypatch.setattr(events_mod.torch.cuda, "current_stream", lambda: schedule)
    runner._fence()
    assert log == ["schedule waits forward"]
    runner.parts.forward_stream = None  # CPU, or no overlap: nothing to order
    runner._fence()
    assert log == ["schedule waits forward"]


def test_the_step_fences_before_any_event_rewrite():
    """step.compress: one plan, its openings applied, its spread parts (settled rows only) scored,
    then the event, which settles, fences and only then rewrites rows."""
    order = []
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.cfg = types.SimpleNamespace(trigger="schedule")
    rt.decode_steps, rt.stats = 1, KaraStats()
    rt.observers, rt.plan_check = Observers(), None
    rt.observers.fenced = lambda: order.append("fence")
    job = types.SimpleNamespace(req=object())

    def plan(reqs, state_of, step):
        order.append("plan")
        return StepPlan(chunks=[("job", 1)], jobs=[job])

    runner = EventRunner.__new__(EventRunner)
    runner.observers = rt.observers
    runner.parts = types.SimpleNamespace(forward_stream=None)
    runner.advance = lambda chunks: order.append("advance")
    runner._settle = lambda pending: order.append("settle") or []
    runner.stats, runner.metrics = rt.stats, None
    rt.events = runner
    rt.planner = types.SimpleNamespace(
        plan=plan, again=lambda reqs, state_of, step, done: []
    )
    rt.state_of = lambda req: None
    runner.parts.req_to_token = torch.zeros(1, 1)
    runner.parts.recompute_tokens = 8
    job.region = types.SimpleNamespace(shape=(1,), query_len=1)
    step_mod.compress(rt, types.SimpleNamespace(reqs=[]), [])
    assert order == ["plan", "advance", "settle", "fence"]


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
