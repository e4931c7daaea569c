"""Tensor parallelism's machinery without an engine (docs/TENSOR_PARALLEL.md):

- the CPU start-up hooks (sgl_kara/cpu/parallel.py): no PyNccl communicator where the caller
  left it to SGLang's default; the cores split among the ranks when no binding was given, read
  back through SGLang's own ``init_threads_binding``;
- the lockstep (scheduler/tp_lockstep.py) on two real ranks (forked processes, a gloo group):
  equal plans gather and pass; a rank whose plan differs makes every rank raise at the same
  gather, naming it; an event group that fails on one rank only (an injected fault just before
  the commit) is undone on both, its request failed on both, and both pools and rows stay
  identical -- without the agreement they diverge (the control);
- replicated KV heads refused for policies that score from attention.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from sgl_kara.scheduler.tp_lockstep import first_divergent


# ------------------------------------------------------------------ CPU start-up hooks
def test_no_pynccl_where_sglang_would_default_to_it():
    from sgl_kara.cpu.parallel import model_parallel_group_hook

    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "group"

    assert model_parallel_group_hook(original, [[0, 1]], 0, "gloo") == "group"
    assert calls[-1] == (([[0, 1]], 0, "gloo", False), {})
    model_parallel_group_hook(
        original, [[0, 1]], 0, "gloo", use_pynccl=True, group_name="tp"
    )
    assert calls[-1] == (([[0, 1]], 0, "gloo", True), {"group_name": "tp"})
    model_parallel_group_hook(original, [[0, 1]], 1, "gloo", None, False)
    assert calls[-1] == (([[0, 1]], 1, "gloo", False, False), {})
    model_parallel_group_hook(original, [[0, 1]], 0, "mccl")  # another device's backend
    assert calls[-1] == (([[0, 1]], 0, "mccl", None), {})


@pytest.fixture
def no_bind(monkeypatch):
    from sgl_kara.cpu import parallel

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    pinned = []
    monkeypatch.setattr(parallel, "pin", pinned.append)
    monkeypatch.setattr(parallel, "sglang_binds_threads", lambda: False)
    return pinned


def test_cores_split_among_ranks_through_sglangs_own_binding(no_bind, monkeypatch):
    """SGLang's ``init_threads_binding`` itself, on this machine's NUMA nodes: without the hook it
    refuses more ranks than nodes; with it each rank gets its own cores and is pinned to them."""
    import inspect

    from sglang.srt.utils import numa_utils

    from sgl_kara.cpu import _sglang as kit
    from sgl_kara.cpu.cores import split_cores
    from sgl_kara.cpu.parallel import threads_binding_hook

    # SGLang's own function (this process may have applied the plugin's hooks to it already)
    sglang_binding = inspect.unwrap(numa_utils.init_threads_binding)
    nodes = kit.get_cpu_ids_by_node()
    cores = sum(len(n.split(",")) for n in nodes if n)
    ranks = len(nodes) + 1  # more ranks than nodes: SGLang's default refuses
    if cores < ranks:
        pytest.skip("one core per NUMA node: no split to make")
    with pytest.raises(AssertionError, match="SGLANG_CPU_OMP_THREADS_BIND is not set"):
        sglang_binding(numa_index=0, world_size=ranks)
    want = split_cores(nodes, ranks).split("|")
    got = [
        threads_binding_hook(sglang_binding, numa_index=r, world_size=ranks)
        for r in range(ranks)
    ]
    assert got == want and no_bind == want
    assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "|".join(want)


def test_a_users_binding_and_a_single_rank_are_left_alone(no_bind, monkeypatch):
    from sgl_kara.cpu import _sglang as kit
    from sgl_kara.cpu.parallel import threads_binding_hook

    monkeypatch.setattr(kit, "get_cpu_ids_by_node", lambda: ["0-3"])
    seen = []

    def original(*, numa_index, world_size):
        seen.append(os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"))
        return ["0-3", "x"][numa_index]

    assert threads_binding_hook(original, numa_index=0, world_size=1) == "0-3"
    assert seen == [None] and no_bind == []  # one rank: SGLang's default, not pinned
    assert threads_binding_hook(original, numa_index=1, world_size=2) == "x"
    assert seen[-1] == "0-1|2-3"  # the split, set for SGLang to read
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "1|0")
    threads_binding_hook(original, numa_index=0, world_size=2)
    assert seen[-1] == "1|0"  # the user's, as given
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    threads_binding_hook(original, numa_index=0, world_size=8)  # more ranks than cores
    assert seen[-1] is None  # left to SGLang's own refusal


@pytest.fixture
def plenty_of_ram(monkeypatch):
    """The launcher's RAM check passes whatever else runs on this machine."""
    from sgl_kara.cpu import server as cpu_server

    monkeypatch.setattr(cpu_server, "available_ram_bytes", lambda: 1 << 40)


@pytest.fixture
def two_cores(monkeypatch, plenty_of_ram):
    from sgl_kara.cpu import _sglang as kit

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(kit, "get_cpu_ids_by_node", lambda: ["0,1"])


def test_both_entry_points_split_the_cores_for_tp(two_cores, tiny_llama):
    """``launch_server --tp-size 2`` and ``Engine(tp_size=2)``, compression on, no variable set:
    accepted, one core per rank."""
    from support import PROXY_MODEL

    from sgl_kara.engine import build_server_args
    from sgl_kara.launch_server import parse

    cfg, sa = parse(["--model-path", PROXY_MODEL, "--tp-size", "2"])
    assert cfg.enabled and sa.tp_size == 2
    assert os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND") == "0|1"
    cfg, sa = build_server_args({"model_path": tiny_llama, "tp_size": 2})
    assert cfg.enabled and sa.tp_size == 2
    assert os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND") == "0|1"


def test_tp_and_dp_beyond_the_cores_are_refused_unless_bound(two_cores, capsys):
    """--tp-size 2 --dp-size 2 is 4 ranks: on 2 cores refused by default, naming both flags and
    the binding that shares the cores; with that binding given, accepted."""
    from support import PROXY_MODEL

    from sgl_kara.launch_server import parse

    argv = ["--model-path", PROXY_MODEL, "--tp-size", "2", "--dp-size", "2"]
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--dp-size 2 x --tp-size 2: 4 scheduler ranks need a CPU core each, but this "
        "process may use 2 (0-1); set SGLANG_CPU_OMP_THREADS_BIND to share cores (e.g. "
        "SGLANG_CPU_OMP_THREADS_BIND='0|1|0|1'" in err
    ), err
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1|0|1"
    cfg, sa = parse(argv)
    assert (sa.tp_size, sa.dp_size) == (2, 2)
    assert os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND") == "0|1|0|1"


# ------------------------------------------------------------------ lockstep on two ranks
@pytest.mark.parametrize(
    "values,odd",
    [
        ([5, 5], None),
        ([5, 6], 1),
        ([6, 5, 5], 0),
        ([5, 6, 5], 1),
        ([5, 5, 6, 6], 2),  # a tie: rank 0's value is the reference
    ],
)
def test_the_rank_named_is_the_first_that_differs_from_the_majority(values, odd):
    assert first_divergent(values) == odd


def _rank_main(rank: int, store: str, out: str) -> None:
    """One rank: every scenario in turn on the same gloo group; results to ``out``.rank.json."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    group = dist.new_group([0, 1], backend="gloo")
    results = {
        "digest": _digest_scenario(rank, group),
        **{
            f"{layout}_{agree}": _fault_scenario(rank, group, layout, agree)
            for layout in ("groups", "one_group")
            for agree in ("agreed", "unagreed")
        },
    }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _digest_scenario(rank: int, group) -> dict:
    from types import SimpleNamespace

    from sgl_kara.policies.base import Region
    from sgl_kara.scheduler.tp_lockstep import PlanDigest, PlanDivergence

    def job(rid, start):
        return SimpleNamespace(
            req=SimpleNamespace(rid=rid),
            index=0,
            region=Region(start, 32, 8, start, 40),
            fresh_slots=lambda page: 8,
        )

    check = PlanDigest(rank, 2, group)
    agreed = 0
    for step in range(3):  # the same plans: every gather passes
        check.planned([job("a", 10 + step)], 1)
        check.check(step, "event")
        check.fold("state", step)
        check.check(step, "step")
        agreed += 2
    # rank 1 plans one more job: both ranks raise at the same (next) gather
    check.planned([job("a", 20), *([job("b", 20)] if rank == 1 else [])], 1)
    try:
        check.check(3, "event")
        error = None
    except PlanDivergence as e:
        error = str(e)
    return {"agreed": agreed, "gathers": check.gathers, "error": error}


def _fault_scenario(rank: int, group, layout: str, agree: str) -> dict:
    """The event transaction world (tests/test_event_transaction.py) on each rank: identical pools
    and plans; a fault injected just before the commit of the victim's group, on rank 1 only."""
    from test_event_transaction import plan, world

    from sgl_kara.diagnostics import fault_observers
    from sgl_kara.scheduler.events import EventRunner
    from sgl_kara.scheduler.observers import Observers
    from sgl_kara.scheduler.scoring import Scorer
    from sgl_kara.scheduler.shared import StepShared
    from sgl_kara.scheduler.staging import DeviceStaging
    from sgl_kara.scheduler.tp_lockstep import FailureAgreement

    rt, batch, reqs = world([30, 31, 32])
    rt.policy.fail_for = set()
    if layout == "one_group":  # one group of three: undone whole, retried one by one
        for r in reqs:
            r.kara.request["budget"] = 12
    victim = reqs[1]
    staging = DeviceStaging("cpu")
    fault = {
        "KARA_INJECT_FAULT_RID_PREFIX": victim.rid,
        "KARA_INJECT_FAULT_AT": "commit",
        "KARA_INJECT_FAULT_TP_RANK": "1",
    }
    os.environ.update(fault)
    try:
        shared = StepShared(
            rt.policy,
            rt.parts,
            staging,
            stats=rt.stats,
            observers=Observers(fault_observers(rank, 2)),
        )
        runner = EventRunner(
            shared,
            Scorer(shared, rt.forward, None),
            rt.forward,
            agreement=FailureAgreement(rank, 2, group) if agree == "agreed" else None,
        )
        runner.run(batch, plan(rt, reqs))
    finally:
        for name in fault:
            del os.environ[name]
    table = rt.req_to_token
    return {
        "victim": victim.rid,
        "free": sorted(rt.allocator.free_slots),
        "reqs": {
            r.rid: {
                "row": table[
                    int(r.kv.req_pool_idx), : int(r.kv.kv_committed_len)
                ].tolist(),
                "lens": [int(r.kv.kv_committed_len), int(r.kv.kv_allocated_len)],
                "compressions": r.kara.compressions,
                "failed": None
                if r.to_finish is None
                else [r.to_finish.status_code, str(r.to_finish.message)],
                "k": rt.kv_pool.k[0][
                    table[int(r.kv.req_pool_idx), : int(r.kv.kv_committed_len)].long()
                ]
                .sum()
                .item(),
            }
            for r in reqs
        },
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both ranks' results (one fork of two processes for every scenario: this process has
    imported what they run)."""
    tmp = tmp_path_factory.mktemp("tp_ranks")
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, str(tmp / "store"), str(tmp / "result"))
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung in a collective"
    assert [p.exitcode for p in procs] == [0, 0]
    return [json.loads((tmp / f"result.{r}.json").read_text()) for r in range(2)]


def test_equal_plans_pass_and_a_divergence_stops_every_rank_naming_it(two_ranks):
    for rank in two_ranks:
        d = rank["digest"]
        assert d["agreed"] == 6 and d["gathers"] == 7  # one gather past the agreed six
        assert d["error"] is not None
        assert (
            "diverged at decode step 3 (before an event): TP rank 1's plan differs "
            "from TP rank 0's" in d["error"]
        ), d["error"]
    assert two_ranks[0]["digest"]["error"] == two_ranks[1]["digest"]["error"]


@pytest.mark.parametrize("layout", ["groups", "one_group"])
def test_a_group_failing_on_one_rank_is_undone_on_every_rank(two_ranks, layout):
    ranks = [r[f"{layout}_agreed"] for r in two_ranks]

    def replicated(run):  # rows, lengths, compressions, free slots, kept K bytes
        reqs = {
            rid: {k: v for k, v in req.items() if k != "failed"}
            for rid, req in run["reqs"].items()
        }
        return run["free"], reqs

    assert replicated(ranks[0]) == replicated(ranks[1])
    victim = ranks[0]["victim"]
    for run in ranks:
        for rid, req in run["reqs"].items():
            if rid == victim:
                assert req["compressions"] == 0 and req["failed"][0] == 500, req
            else:
                assert req["compressions"] == 1 and req["failed"] is None, req
    assert "failed on tensor-parallel rank 1" in ranks[0]["reqs"][victim]["failed"][1]
    assert "injected fault at commit" in ranks[1]["reqs"][victim]["failed"][1]


@pytest.mark.parametrize("layout", ["groups", "one_group"])
def test_without_the_agreement_the_ranks_diverge(two_ranks, layout):
    """The control: the same fault with no agreement leaves rank 0 compressing the victim that
    rank 1 left as it was -- the state the agreement prevents."""
    ranks = [r[f"{layout}_unagreed"] for r in two_ranks]
    victim = ranks[0]["victim"]
    assert ranks[0]["reqs"][victim]["compressions"] == 1
    assert ranks[1]["reqs"][victim]["compressions"] == 0
    assert ranks[0]["reqs"][victim]["row"] != ranks[1]["reqs"][victim]["row"]


# ------------------------------------------------------------------ replicated KV heads
def test_replicated_kv_heads_are_refused_for_attention_scored_policies():
    from sgl_kara.config import KaraConfig
    from sgl_kara.startup import replicated_kv_heads

    for policy in ("kara", "snapkv", "rkv", "h2o"):
        why = replicated_kv_heads(1, 2, KaraConfig(policy=policy), "--model-path m")
        assert why.startswith(
            f"--tp-size 2 is not supported with --kara-policy {policy}"
        )
        assert "which has 1 KV head:" in why and "on 2 ranks" in why
    for policy in ("streaming", "random"):
        assert replicated_kv_heads(1, 2, KaraConfig(policy=policy), "m") is None
    assert replicated_kv_heads(4, 2, KaraConfig(), "m") is None  # split, not replicated
    assert replicated_kv_heads(2, 2, KaraConfig(), "m") is None
    assert replicated_kv_heads(1, 1, KaraConfig(), "m") is None


def test_replicated_kv_heads_refused_at_start(tmp_path, capsys, plenty_of_ram):
    from bench.models.tiny import write_tiny_model
    from sgl_kara.launch_server import parse

    model = str(write_tiny_model(tmp_path / "mqa", "llama", num_kv_heads=1, seed=3))
    with pytest.raises(SystemExit) as e:
        parse(["--model-path", model, "--tp-size", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --tp-size 2 is not supported with --kara-policy kara" in err, err
    cfg, sa = parse(
        ["--model-path", model, "--tp-size", "2", "--kara-policy", "streaming"]
    )
    assert cfg.policy == "streaming" and sa.tp_size == 2


def test_tensor_parallel_scores_the_ranks_heads_only():
    """A rank's random draws are the model's draws for its heads (the policy sees which heads the
    rank holds), so a split over ranks keeps what one rank keeps."""
    from support import make_policy, score_input

    policy = make_policy("random", window=40, buffer=8, seed=3)
    whole = policy.score(score_input(policy))  # [B, H_kv = 2, M]
    for rank in range(2):
        inp = score_input(policy)
        inp.k_buffer = inp.k_buffer[:, rank : rank + 1]
        inp.head_offset, inp.model_heads = rank, 2
        assert torch.equal(policy.score(inp), whole[:, rank : rank + 1])
