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
        return StepPlan(chunks=[("job", 1)], passes=[[job]])

    runner = EventRunner.__new__(EventRunner)
    runner.observers = rt.observers
    runner.parts = types.SimpleNamespace(forward_stream=None)
    runner.advance = lambda chunks: order.append("advance")
    runner._settle = lambda pending: order.append("settle") or []
    runner.stats, runner.metrics = rt.stats, None
    rt.events = runner
    rt.planner = types.SimpleNamespace(plan=plan)
    rt.table = types.SimpleNamespace(state_of=lambda req: None)
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


OBSERVERS = "scheduler/observers.py"


def test_a_decode_step_reads_top_down():
    """A decode step followed through the code (a real runtime's step over three requests an
    event compresses): no module of sgl_kara is entered again while a call of it is still open
    further up (no callback: the step calls down, each part returns), and among the step's own
    parts it goes back to a module it had left at most 3 times. The step observers' hook points
    (observers.py) are left out of that count: in production their list is empty (a diagnostic
    registers one only where a KARA_* variable asks), so a reader never follows them."""
    import pathlib
    import sys

    from test_event_transaction import world

    import sgl_kara
    from sgl_kara.scheduler.plan import Planner
    from sgl_kara.scheduler.scoring import Scorer
    from sgl_kara.scheduler.shared import StepShared
    from sgl_kara.scheduler.staging import DeviceStaging
    from sgl_kara.scheduler.state import RequestTable

    w, b, reqs = world([30, 31, 32])
    w.parts.overlap, w.parts.forward_stream, w.parts.waiting = False, None, lambda: 0
    w.forward.sync_offset = lambda row, state: None
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.cfg = types.SimpleNamespace(
        phase="request", spread="off", spread_max=0, max_seqs=30, trigger="schedule"
    )
    rt.policy, rt.parts, rt.forward, rt.ring = w.policy, w.parts, w.forward, None
    rt.observers, rt.stats, rt.metrics = Observers(), KaraStats(), None
    rt.plan_check, rt.decode_steps = None, 0
    rt.table = RequestTable(w.policy)
    for r in reqs:
        r.kara.protected = -1
        rt.table.add(r, r.kara)
    shared = StepShared(w.policy, w.parts, DeviceStaging("cpu"), stats=rt.stats)
    rt.planner = Planner(w.policy, rt.cfg, w.parts)
    rt.events = EventRunner(shared, Scorer(shared, w.forward, None), w.forward)
    b.batch_is_full = True
    root = pathlib.Path(sgl_kara.__file__).parent
    # the step's own parts (the adapter, policies, kernels and mem_cache are what they call)
    own = {"scheduler", "backends"}
    trail = []

    def profile(frame, event, arg):
        path = pathlib.Path(frame.f_code.co_filename)
        if event in ("call", "return") and path.is_relative_to(root):
            rel = path.relative_to(root)
            if rel.parts[0] in own:
                trail.append((event, str(rel)))

    sys.setprofile(profile)
    try:
        rt.on_decode_step(b)
    finally:
        sys.setprofile(None)
    assert rt.stats.requests_compressed == 3 and b.batch_is_full is False
    stack, callbacks, step_calls = [], [], []
    for event, module in trail:
        if event == "return":
            stack.pop()
            continue
        if stack and module != stack[-1] and module in stack:
            callbacks.append(f"{stack[-1]} -> {module}")
        caller = stack[-1] if stack else None
        if caller == "scheduler/step.py" and module not in (caller, OBSERVERS):
            if not step_calls or step_calls[-1] != module:
                step_calls.append(module)  # the step's callees in order, repeats merged
        stack.append(module)
    assert not callbacks, sorted(set(callbacks))
    assert "scheduler/plan.py" in step_calls and "scheduler/events.py" in step_calls
    returns = len(step_calls) - len(set(step_calls))
    assert returns <= 3, step_calls
