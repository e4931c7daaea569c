"""GPU configurations resolved by SGLang 0.5.23 itself, without a GPU: real ``ServerArgs``, real
``resolve_once`` (``parse_cuda_graph_config`` and every other resolution step), with only what
reports the device said to be a CUDA H100 (SGLang's ``override_platform``, its CUDA probe, its GPU
memory and device queries). No engine starts.

- the GPU suite's options (tests/gpu_checks.py ``device_options``) for every backend and page
  size build and resolve, for vanilla SGLang and for sgl_kara;
- every policy x query source x {SGLang's default, ``--cuda-graph-backend-decode full``,
  ``--cuda-graph-config '{"decode": {"backend": "full"}}'``, ``--disable-cuda-graph``} through the
  launcher's ``parse``: a configuration that needs the attention hook at every decode step (H2O's
  observer, the capture ring) never resolves to a replayed decode graph -- refused (exit 2, naming
  the flag) when the user asked for decode graphs, turned off otherwise; the others keep SGLang's
  graphs; ``auto`` never turns them off;
- Kara's memory beside the pool is taken from the pool's share of the GPU: the resolved
  ``mem_fraction_static`` is SGLang's own minus that memory over the GPU's.
"""

from __future__ import annotations

import json
import types

import gpu_checks as gc
import pytest
import torch
from conftest import ENGINE_COMMON

H100_MIB = 81559  # what nvidia-smi reports for an H100 80GB
BACKENDS = ("fa3", "flashinfer", "triton")
EXPLICIT_GRAPHS = {
    "--cuda-graph-backend-decode": ["--cuda-graph-backend-decode", "full"],
    "--cuda-graph-config": [
        "--cuda-graph-config",
        json.dumps({"decode": {"backend": "full"}}),
    ],
}
GRAPH_FLAGS = {
    "default": [],
    **EXPLICIT_GRAPHS,
    "--disable-cuda-graph": ["--disable-cuda-graph"],
}


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    return gc.write_gpu_model(str(tmp_path_factory.mktemp("gpu_llama")))


@pytest.fixture
def cuda_assumed(monkeypatch):
    """SGLang (and sgl_kara) told they run on one H100: the platform facts, SGLang's CUDA probe
    (``is_cuda``), the device ``get_device`` reports and the GPU memory ``nvidia-smi`` would give.
    SGLang's modules are imported first, as on a GPU machine (their import-time probes ran)."""
    import sgl_kara._sglang as kara_sglang
    from sgl_kara import startup as support
    from sgl_kara.plugin import register

    register()
    import sglang.srt.arg_groups.kv_shard_hook as kv_shard_hook
    import sglang.srt.arg_groups.memory_hook as memory_hook
    import sglang.srt.arg_groups.serving_hook as serving_hook
    import sglang.srt.utils as sglang_utils
    import sglang.srt.utils.common as common
    from sglang.srt.runtime_context import override_platform

    for mod in (common, sglang_utils):
        monkeypatch.setattr(mod, "is_cuda", lambda: True)
    for mod in (common, memory_hook, kv_shard_hook, kara_sglang):
        monkeypatch.setattr(
            mod, "get_device_memory_capacity", lambda device=None: H100_MIB
        )
    monkeypatch.setattr(serving_hook, "get_device", lambda device_id=None: "cuda")
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(total_memory=H100_MIB << 20),
    )
    monkeypatch.setattr(support, "cuda_available", lambda: True)
    monkeypatch.setattr(gc, "cuda", lambda: True)
    with override_platform(
        is_cuda=True,
        is_hip=False,
        is_sm90=True,
        is_sm100=False,
        is_sm100_or_sm110=False,
        is_sm110=False,
        is_sm120=False,
        is_blackwell=False,
        is_hopper_with_cuda_12_3=True,
        has_flashinfer=True,
        device_sm=90,
        device_capability=(9, 0),
    ):
        yield


def resolved(server_args):
    from sglang.srt.arg_groups.overrides import resolving_view

    server_args.resolve_once()
    return resolving_view(server_args)


def decode_backend(server_args) -> str:
    return resolved(server_args).cuda_graph_config.decode.backend


# ------------------------------------------------------------------ the GPU suite's engines
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [1, 64])
def test_gpu_suite_options_resolve_for_vanilla_and_kara(
    cuda_assumed, gpu_model, backend, page
):
    """Each engine the GPU suite starts: vanilla SGLang (graphs on, and off as a capture run's
    reference) and sgl_kara with recompute (graphs kept) and capture (decode graphs off), with
    the suite's graph sizes."""
    from sglang.srt.server_args import ServerArgs

    from sgl_kara.engine import build_server_args

    opts = gc.device_options(backend, page)
    for graphs_off in (False, True):
        r = resolved(
            ServerArgs(
                model_path=gpu_model,
                disable_decode_cuda_graph=graphs_off,
                **ENGINE_COMMON,
                **opts,
            )
        )
        assert (r.attention_backend, r.page_size, r.device) == (backend, page, "cuda")
        assert r.cuda_graph_config.decode.backend == (
            "disabled" if graphs_off else "full"
        )
        assert r.cuda_graph_config.decode.max_bs == gc.DECODE_GRAPH_MAX_BS
        assert max(r.cuda_graph_config.decode.bs) == gc.DECODE_GRAPH_MAX_BS
        assert r.cuda_graph_config.prefill.max_bs == gc.PREFILL_GRAPH_MAX_TOKENS
    for qs, graphs in (("recompute", "full"), ("capture", "disabled")):
        cfg, sa = build_server_args(
            {
                **ENGINE_COMMON,
                "model_path": gpu_model,
                "kara_retention": 1.0,
                "kara_query_source": qs,
                **{f"kara_{k[5:]}": v for k, v in gc.KARA_SMALL.items()},
                **opts,
            }
        )
        assert cfg.query_source == qs
        assert decode_backend(sa) == graphs
        assert gc.decode_graphs_off(sa) is (graphs == "disabled")


# ------------------------------------------------------------------ policy x query source x graph flags
def _policies():
    from sgl_kara.config import policy_names

    return [p for p in policy_names() if p != "none"]


def _parse(model, argv):
    from sgl_kara.launch_server import parse

    return parse(["--model-path", model, "--max-running-requests", "16", *argv])


@pytest.mark.parametrize("graphs", sorted(GRAPH_FLAGS))
@pytest.mark.parametrize("query_source", ["auto", "recompute", "capture"])
def test_decode_graphs_never_replay_past_the_attention_hook(
    cuda_assumed, gpu_model, capsys, query_source, graphs
):
    for policy in _policies():
        argv = [
            "--kara-policy",
            policy,
            "--kara-query-source",
            query_source,
            *GRAPH_FLAGS[graphs],
        ]
        try:
            cfg, sa = _parse(gpu_model, argv)
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 2, (policy, err)
            assert graphs in EXPLICIT_GRAPHS, (policy, query_source, graphs, err)
            assert f"error: {graphs} asks for decode CUDA graphs" in err, err
            assert policy == "h2o" or query_source == "capture", (
                policy,
                query_source,
                err,
            )
            continue
        backend = decode_backend(sa)
        # H2O observes every decode step's attention; a capture ring (a policy that scores with
        # queries) is written at every decode step: both in the attention hook.
        needs_hook = (
            policy == "h2o"
            or cfg.query_source == "capture"
            and cfg.query_ring_capacity > 0
        )
        if needs_hook:
            assert graphs not in EXPLICIT_GRAPHS, (policy, query_source, graphs)
            assert backend == "disabled", (policy, query_source, graphs, backend)
        else:
            assert backend == (
                "disabled" if graphs == "--disable-cuda-graph" else "full"
            ), (policy, graphs, backend)
        if query_source == "auto" and graphs != "--disable-cuda-graph":
            assert cfg.query_source == "recompute", (
                policy,
                graphs,
            )  # auto keeps the decode graphs


def test_auto_captures_only_where_decode_graphs_are_off_anyway(cuda_assumed, gpu_model):
    """A small ring (16 requests) within 5% of the GPU: auto picks capture only with
    --disable-cuda-graph; with SGLang's default it keeps recompute and the decode graphs."""
    cfg, sa = _parse(gpu_model, ["--disable-cuda-graph"])
    assert cfg.query_source == "capture" and decode_backend(sa) == "disabled"
    cfg, sa = _parse(gpu_model, [])
    assert cfg.query_source == "recompute" and decode_backend(sa) == "full"


def test_decode_graphs_asked_for_through_engine_keywords_are_refused(
    cuda_assumed, gpu_model
):
    from sgl_kara.engine import build_server_args
    from sgl_kara.startup import UnsupportedFeature

    base = {**ENGINE_COMMON, "model_path": gpu_model}
    for kw, flag in (
        (dict(cuda_graph_backend_decode="breakable"), "--cuda-graph-backend-decode"),
        (
            dict(cuda_graph_config={"decode": {"backend": "full"}}),
            "--cuda-graph-config",
        ),
    ):
        with pytest.raises(
            UnsupportedFeature, match=f"{flag} asks for decode CUDA graphs"
        ):
            build_server_args({**base, "kara_policy": "h2o", **kw})
        with pytest.raises(UnsupportedFeature, match="--kara-query-source capture"):
            build_server_args({**base, "kara_query_source": "capture", **kw})
        cfg, sa = build_server_args({**base, "kara_query_source": "recompute", **kw})
        assert decode_backend(sa) != "disabled"
    # A JSON config that leaves the decode backend alone: turned off for H2O, prefill untouched.
    cfg, sa = build_server_args(
        {**base, "kara_policy": "h2o", "cuda_graph_config": {"decode": {"max_bs": 8}}}
    )
    r = resolved(sa)
    assert (
        r.cuda_graph_config.decode.backend == "disabled"
        and r.cuda_graph_config.prefill.backend == "breakable"
    )


def test_capture_needs_a_known_request_limit_on_cuda(cuda_assumed, gpu_model, capsys):
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", gpu_model, "--kara-query-source", "capture"])
    assert e.value.code == 2
    assert "--max-running-requests or --kara-query-ring-rows" in capsys.readouterr().err
    cfg, sa = parse(
        [
            "--model-path",
            gpu_model,
            "--kara-query-source",
            "capture",
            "--kara-query-ring-rows",
            "32",
        ]
    )
    assert cfg.query_source == "capture" and decode_backend(sa) == "disabled"


# ------------------------------------------------------------------ Kara's memory taken from the pool
def _vanilla_fraction(model, argv):
    from sgl_kara._sglang import prepare_server_args

    return resolved(
        prepare_server_args(["--model-path", model, *argv])
    ).mem_fraction_static


@pytest.mark.parametrize(
    "argv",
    [
        ["--kara-query-source", "recompute"],
        [
            "--kara-query-source",
            "capture",
            "--kara-window",
            "512",
            "--kara-period",
            "128",
        ],
        ["--kara-policy", "h2o"],
        ["--kara-policy", "snapkv", "--mem-fraction-static", "0.8"],
    ],
    ids=["kara-recompute", "kara-capture", "h2o", "snapkv-user-fraction"],
)
def test_kara_memory_is_taken_from_the_pool(cuda_assumed, monkeypatch, gpu_model, argv):
    """The resolved fraction is SGLang's own for the same SGLang flags (its heuristic, or the
    user's) less Kara's memory over the GPU's; the ring term is the ring the scheduler allocates."""
    from sgl_kara import startup as support
    from sgl_kara.model_shape import ModelShape, ring_bytes

    plans = []
    real = support.reserve_device_memory
    monkeypatch.setattr(
        support, "reserve_device_memory", lambda *a: plans.append(real(*a)) or plans[-1]
    )
    cfg, sa = _parse(gpu_model, argv)
    sglang_flags = ["--max-running-requests", "16"]
    if "--mem-fraction-static" in argv:
        sglang_flags += ["--mem-fraction-static", "0.8"]
    if support.hooks_every_decode_step(cfg):
        sglang_flags += [
            "--disable-decode-cuda-graph"
        ]  # Kara's run resolves its graphs this way
    sglang_fraction = _vanilla_fraction(gpu_model, sglang_flags)
    if "--mem-fraction-static" in argv:
        assert sglang_fraction == 0.8
    (plan,) = plans
    total = H100_MIB * (1 << 20)
    share = -(-1000 * sum(plan.values()) // total) / 1000
    assert share > 0 and plan["event_scores"] > 0
    assert resolved(sa).mem_fraction_static == pytest.approx(
        round(sglang_fraction - share, 3)
    )
    shape = ModelShape.from_model_path(gpu_model)
    if cfg.query_source == "capture":
        # --max-running-requests 16 rows (the pool bounds no further) of W + delta queries, at the
        # checkpoint's itemsize (float32 here: a plan above SGLang's float16 serving dtype, not below)
        itemsize = shape.itemsize(sa.dtype)
        assert itemsize == 4
        want = ring_bytes(
            16, 512 + 128, [(shape.q_heads, shape.head_dim)] * shape.layers, itemsize
        )
        assert (
            plan["capture_ring"]
            == want
            == 17 * 640 * shape.layers * shape.q_heads * shape.head_dim * 4
        )
    else:
        assert plan["capture_ring"] == 0
    assert (plan["observer"] > 0) == (cfg.policy == "h2o")


def test_kara_memory_that_leaves_no_pool_is_refused(cuda_assumed, gpu_model, capsys):
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(
            [
                "--model-path",
                gpu_model,
                "--kara-query-source",
                "capture",
                "--max-running-requests",
                "65536",
                "--kara-window",
                "65536",
                "--kara-buffer",
                "32",
            ]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        "leaves no KV pool" in err
        and "--max-running-requests" in err
        and "--kara-query-source recompute" in err
    )


def test_the_scheduler_allocates_the_ring_within_the_start_up_plan(
    monkeypatch, gpu_model
):
    """On CUDA the ring's rows come from the scheduler's limits and must not outgrow the rows the
    start-up plan took from the pool (--max-running-requests / --kara-query-ring-rows); a larger
    ring is refused before it is allocated."""
    from sgl_kara._sglang import RadixAttention, attention_layers
    from sgl_kara.config import KaraConfig
    from sgl_kara.model_shape import ModelShape, ring_bytes
    from sgl_kara.scheduler.ring import make_ring
    from sgl_kara.startup import UnsupportedFeature

    shape = ModelShape.from_model_path(gpu_model)
    made = []
    from sgl_kara.scheduler import ring as ring_module

    monkeypatch.setattr(
        ring_module,
        "QueryRing",
        lambda layers, rows, capacity, *a, **kw: (
            made.append(
                types.SimpleNamespace(
                    rows=rows, nbytes=ring_bytes(rows, capacity, layers.values(), 2)
                )
            )
            or made[-1]
        ),
    )

    def ring(planned_running, running, pool, cap=0):
        cfg = KaraConfig.build(
            query_source="capture", query_ring_rows=cap, window=64, buffer=8, period=16
        )
        server_args = types.SimpleNamespace(
            max_running_requests=planned_running, max_total_tokens=None
        )
        cuda_table = types.SimpleNamespace(
            device=torch.device("cuda"), shape=(running + 1, 64)
        )
        model = torch.nn.ModuleList(
            RadixAttention(
                shape.q_heads, shape.head_dim, 1.0, shape.kv_heads, layer_id=i
            )
            for i in range(shape.layers)
        )
        parts = types.SimpleNamespace(  # SchedulerParts as the adapter reads the model
            max_running=running,
            pool_tokens=pool,
            server_args=server_args,
            dtype=torch.bfloat16,
            layer_ids=attention_layers(model),
            q_heads=shape.q_heads,
            head_dim=shape.head_dim,
            req_to_token=cuda_table,
        )
        return make_ring(parts, cfg, cfg.make_policy().schedule.query_capacity())

    assert ring(16, 16, 1 << 20).rows == 16
    assert (
        ring(16, 16, 80 * 10).rows == 10
    )  # the pool bounds it further: 800 tokens / 80 queries
    assert (
        ring(None, 64, 1 << 20, cap=8).rows == 8
    )  # --kara-query-ring-rows alone planned it
    with pytest.raises(
        UnsupportedFeature, match=r"\(8 rows\) was taken from the KV pool at start-up"
    ):
        ring(8, 32, 1 << 20)  # the scheduler runs more requests than the plan counted
    assert len(made) == 3


# ------------------------------------------------------------------ tensor parallelism
def _plan_of(monkeypatch, gpu_model, argv):
    """(KaraConfig, ServerArgs, Kara's memory plan beside the pool) of ``parse(argv)``."""
    from sgl_kara import startup as support

    plans = []
    real = support.reserve_device_memory
    monkeypatch.setattr(
        support, "reserve_device_memory", lambda *a: plans.append(real(*a)) or plans[-1]
    )
    cfg, sa = _parse(gpu_model, argv)
    monkeypatch.setattr(support, "reserve_device_memory", real)
    (plan,) = plans
    return cfg, sa, plan


@pytest.mark.parametrize("query_source", ["recompute", "capture"])
def test_tensor_parallel_resolves_as_sglang_does_with_kara_memory_per_rank(
    cuda_assumed, monkeypatch, gpu_model, query_source
):
    """``--tp-size 2`` on CUDA: SGLang's own TP resolution (NCCL communicators: no sgl_kara hook
    in a CUDA process; custom all-reduce as SGLang sets it; decode graphs kept with recompute,
    off with the capture ring), and Kara's memory planned per rank: each rank holds half the
    query and KV heads, so the ring and the score buffers are half of one rank at TP 1, and the
    fraction is SGLang's own for TP 2 less that per-rank memory over one GPU."""
    from sgl_kara import plugin
    from sgl_kara._sglang import prepare_server_args

    monkeypatch.setattr(plugin, "cuda_available", lambda: True)
    assert (
        "parallel" not in plugin.wanted_parts()
    )  # SGLang's NCCL / PyNccl choice stands
    argv = ["--kara-query-source", query_source]
    cfg1, _, plan1 = _plan_of(monkeypatch, gpu_model, argv)
    cfg2, sa2, plan2 = _plan_of(monkeypatch, gpu_model, [*argv, "--tp-size", "2"])
    assert cfg1.query_source == cfg2.query_source == query_source
    r = resolved(sa2)
    sglang_flags = ["--max-running-requests", "16", "--tp-size", "2"]
    if query_source == "capture":
        sglang_flags.append("--disable-decode-cuda-graph")
    vanilla = resolved(prepare_server_args(["--model-path", gpu_model, *sglang_flags]))
    assert r.tp_size == vanilla.tp_size == 2 and not r.enable_dp_attention
    assert r.disable_custom_all_reduce == vanilla.disable_custom_all_reduce
    assert r.cuda_graph_config.decode.backend == (
        "disabled" if query_source == "capture" else "full"
    )
    assert (
        r.cuda_graph_config.decode.backend == vanilla.cuda_graph_config.decode.backend
    )
    for part in ("capture_ring", "event_scores", "spread_scores"):
        assert plan2[part] * 2 == plan1[part], (part, plan1, plan2)
    assert (plan2["capture_ring"] > 0) is (query_source == "capture")
    total = H100_MIB * (1 << 20)
    share = -(-1000 * sum(plan2.values()) // total) / 1000
    assert r.mem_fraction_static == pytest.approx(
        round(vanilla.mem_fraction_static - share, 3)
    )


def test_tensor_parallel_refusals_on_cuda(cuda_assumed, gpu_model, capsys):
    """DP attention stays refused under TP; a --tp-size above the model's 2 KV heads (SGLang
    replicates each head on two ranks) is refused for a policy that scores from attention, naming
    the flag and the heads, and served for a positional one."""
    from sgl_kara.launch_server import parse

    def refused(argv) -> str:
        with pytest.raises(SystemExit) as e:
            parse(["--model-path", gpu_model, "--max-running-requests", "16", *argv])
        assert e.value.code == 2
        return capsys.readouterr().err

    err = refused(["--tp-size", "2", "--enable-dp-attention"])
    assert "error: --enable-dp-attention is not supported" in err, err
    for policy in ("kara", "snapkv", "h2o"):
        err = refused(["--tp-size", "4", "--kara-policy", policy])
        assert (
            f"--tp-size 4 is not supported with --kara-policy {policy}" in err
            and "which has 2 KV heads" in err
            and "replicates each KV head on 2 ranks" in err
        ), err
    cfg, sa = _parse(gpu_model, ["--tp-size", "4", "--kara-policy", "streaming"])
    assert cfg.policy == "streaming" and resolved(sa).tp_size == 4
