"""CPU cores per scheduler rank (sgl_kara/cpu/cores.py) and the launcher's / Engine's default
``SGLANG_CPU_OMP_THREADS_BIND`` for ``--dp-size N``; the memory check per rank. No engine."""

from __future__ import annotations

import random
import types

import pytest

from sgl_kara.cpu import server as cpu_server
from sgl_kara.cpu.cores import (
    THREADS_BIND_VAR,
    format_cpu_list,
    parse_cpu_list,
    split_cores,
)
from sgl_kara.startup import UnsupportedFeature


@pytest.mark.parametrize(
    "nodes, ranks, expected",
    [
        (["0,1"], 2, "0|1"),
        ([",".join(map(str, range(16)))], 2, "0-7|8-15"),
        (["0,1,2,3,4"], 2, "0-2|3-4"),
        (["0,1,2,3", "4,5,6,7"], 4, "0-1|2-3|4-5|6-7"),
        (["0,1,2,3", "4,5,6,7"], 3, "0-2|3-5|6-7"),
        (["0,2,4,6"], 2, "0,2|4,6"),
        (["0-3"], 4, "0|1|2|3"),
    ],
)
def test_split_cores(nodes, ranks, expected):
    assert split_cores(nodes, ranks) == expected


@pytest.mark.parametrize(
    "nodes, ranks", [(["0,1"], 1), (["0-3", "4-7"], 2), (["0-3", "4-7"], 1)]
)
def test_sglang_default_serves(nodes, ranks):
    """One rank, or no more ranks than NUMA nodes: SGLang gives each rank a node itself."""
    assert split_cores(nodes, ranks) is None


def test_fewer_cores_than_ranks_is_refused():
    with pytest.raises(
        ValueError,
        match="3 scheduler ranks need a CPU core each, but this process may use 2 \\(0-1\\)",
    ):
        split_cores(["0,1"], 3)


def test_groups_partition_the_cores_evenly():
    rng = random.Random(0)
    for _ in range(300):
        cores = sorted(rng.sample(range(64), rng.randint(1, 40)))
        cut = rng.randint(0, len(cores))
        nodes = [format_cpu_list(cores[:cut]), format_cpu_list(cores[cut:])]
        ranks = rng.randint(1, len(cores))
        bind = split_cores(nodes, ranks)
        if bind is None:
            assert ranks <= len([n for n in nodes if n])
            continue
        groups = [parse_cpu_list(g) for g in bind.split("|")]
        assert len(groups) == ranks
        assert [c for g in groups for c in g] == cores  # every core once, in order
        assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_cpu_list_round_trip():
    assert parse_cpu_list("0,2,4-6, 9") == [0, 2, 4, 5, 6, 9]
    assert format_cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def _args(**kw):
    return types.SimpleNamespace(
        **{"dp_size": 2, "tp_size": 1, "pp_size": 1, "device": "cpu", **kw}
    )


@pytest.fixture
def two_cores(monkeypatch):
    from sgl_kara.cpu import _sglang

    # set, then deleted: monkeypatch records the variable, so what threads_bind sets is removed
    # after the test (delenv alone records nothing for an unset variable)
    monkeypatch.setenv(THREADS_BIND_VAR, "")
    monkeypatch.delenv(THREADS_BIND_VAR)
    monkeypatch.setattr(_sglang, "get_cpu_ids_by_node", lambda: ["0,1"])


def test_default_threads_bind_sets_the_variable(two_cores):
    import os

    assert cpu_server.threads_bind(_args()) == "0|1"
    assert os.environ[THREADS_BIND_VAR] == "0|1"


@pytest.mark.parametrize("kw", [dict(dp_size=1), dict(device="cuda")])
def test_default_threads_bind_leaves_single_rank_and_gpu_alone(two_cores, kw):
    import os

    assert cpu_server.threads_bind(_args(**kw)) is None
    assert THREADS_BIND_VAR not in os.environ


def test_user_binding_is_kept(two_cores, monkeypatch):
    import os

    monkeypatch.setenv(THREADS_BIND_VAR, "1|0")
    assert cpu_server.threads_bind(_args()) is None
    assert os.environ[THREADS_BIND_VAR] == "1|0"


def test_too_many_replicas_for_the_cores_is_refused(two_cores):
    with pytest.raises(
        UnsupportedFeature, match=f"--dp-size 3 x --tp-size 1: .*set {THREADS_BIND_VAR}"
    ):
        cpu_server.threads_bind(_args(dp_size=3))


def test_launcher_and_engine_set_the_binding(two_cores, tiny_llama):
    """Both entry points: --dp-size 2 is accepted with compression on and the binding is set."""
    import os

    from support import PROXY_MODEL

    from sgl_kara.engine import build_server_args
    from sgl_kara.launch_server import parse

    cfg, sa = parse(["--model-path", PROXY_MODEL, "--dp-size", "2"])
    assert cfg.enabled and sa.dp_size == 2 and os.environ[THREADS_BIND_VAR] == "0|1"
    del os.environ[THREADS_BIND_VAR]
    cfg, sa = build_server_args(
        {"model_path": tiny_llama, "dp_size": 2, "kara_policy": "none"}
    )
    assert sa.dp_size == 2 and os.environ[THREADS_BIND_VAR] == "0|1"


def test_memory_check_counts_every_replica():
    from sgl_kara.cpu.memory import MemoryConfigError, check_cpu_fit
    from sgl_kara.model_shape import ModelShape

    shape = ModelShape(
        layers=2,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        context_len=8192,
        checkpoint_dtype="float32",
        weight_file_bytes=1 << 20,
    )
    one = check_cpu_fit(shape, 4, 4096, 8, 64, 1 << 40)
    two = check_cpu_fit(shape, 4, 4096, 8, 64, 1 << 40, ranks=2)
    for part in ("weights", "kv_pool", "capture_ring"):
        assert two[part] == 2 * one[part]
    assert two["processes"] > one["processes"]  # a scheduler and the DP controller more
    with pytest.raises(
        MemoryConfigError, match="fewer ranks \\(--dp-size x --tp-size: 2\\)"
    ):
        check_cpu_fit(shape, 4, 4096, 8, 64, sum(one.values()) + 1, ranks=2)
