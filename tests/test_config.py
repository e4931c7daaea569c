"""KaraConfig validation and the launcher's refusal of bad flags (before any model loads)."""

import dataclasses
import subprocess
import sys

import pytest

from sgl_kara.config import KaraConfig, KaraConfigError, kept_count


def test_defaults_are_valid_and_documented():
    cfg = KaraConfig()
    o = cfg.options
    assert cfg.policy == "kara" and o.window == 512 and o.buffer == 32
    assert o.kept_per_window == kept_count(480, 0.25) == 120
    assert o.chunk_budget == 16 < o.kept_per_window  # the paper's alpha where K >= 32


@pytest.mark.parametrize(
    "window, buffer, retention, kept, alpha",
    [
        (48, 32, 0.25, 4, 2),  # K = ceil(0.25 x 16)
        (40, 8, 0.25, 8, 4),
        (33, 32, 0.1, 1, 0),  # one compressible token: no chunk at all
        (64, 8, 0.1, 6, 3),  # ceil(0.1 x 56) = 6
        (2, 0, 1.0, 2, 1),
        (4096, 32, 0.05, 204, 16),  # ceil(0.05 x 4064) = 204: the paper's alpha = 16
    ],
)
def test_unset_chunk_budget_is_derived_and_valid_for_any_window(
    window, buffer, retention, kept, alpha
):
    """alpha unset: the paper's 16 where a window keeps enough, else half of what it keeps (values
    worked by hand), always below K -- so a user who only sets --kara-window never gets an error
    about a flag they did not set."""
    o = KaraConfig.build(window=window, buffer=buffer, retention=retention).options
    k = kept_count(window - buffer, retention)
    assert (k, o.chunk_budget) == (kept, alpha)
    assert 0 <= o.chunk_budget < k
    # An explicit value is still checked against the same bound.
    if k <= 16:
        with pytest.raises(KaraConfigError, match="--kara-chunk-budget"):
            KaraConfig.build(
                window=window, buffer=buffer, retention=retention, chunk_budget=k
            )


def test_only_window_on_the_command_line():
    from support import PROXY_MODEL

    from sgl_kara.launch_server import parse

    cfg, _ = parse(["--model-path", PROXY_MODEL, "--kara-window", "48"])
    assert (
        cfg.options.window == 48 and cfg.options.chunk_budget == 2
    )  # K = 4 of 16 compressible: alpha 2


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(retention=1.5), "retention"),
        (dict(retention=0.0), "retention"),
        (dict(retention=float("nan")), "retention"),
        (dict(window=1), "window"),
        (dict(window=64, buffer=64), "buffer"),
        (dict(buffer=-1), "buffer"),
        (dict(window=64, buffer=8, retention=0.1, chunk_budget=6), "chunk_budget"),
        (dict(max_chunk=2), "max_chunk"),
        (dict(policy="h3o"), "policy"),
        (dict(query_source="magic"), "query_source"),
        (dict(period=0), "period"),
        (dict(max_seqs=0), "max_seqs"),
        (dict(window="big"), "window"),
        (dict(retention="0.5"), "retention"),
        (dict(period=True), "period"),
        (
            dict(policy="snapkv", snapkv_budget=2000, snapkv_threshold=1500),
            "snapkv_threshold",
        ),
        (dict(policy="snapkv", snapkv_kernel=4), "snapkv_kernel"),
        (dict(policy="streaming", streaming_sinks=2000), "streaming_sinks"),
        (dict(policy="snapkv", window=64), "window"),  # another policy's option
        (dict(policy="kara", snapkv_budget=300), "snapkv_budget"),
        (dict(policy="none", retention=0.5), "retention"),
        (dict(windw=64), "windw"),
        (dict(scoring="buffer", buffer=0), "buffer"),
        (dict(recent=-1), "recent"),
        (dict(recent=2_000_000), "recent"),
        (dict(recent=1.5), "recent"),
        (dict(policy="random", random_seed=-1), "random_seed"),
        (dict(policy="random", random_window=64, random_buffer=64), "random_buffer"),
        (dict(policy="random", random_retention=0.0), "random_retention"),
        (dict(policy="random", recent=64), "recent"),  # Kara's flag, not random's
    ],
)
def test_invalid_values_name_the_flag(kwargs, name):
    with pytest.raises(KaraConfigError) as e:
        KaraConfig.build(**kwargs)
    assert e.value.name == name
    assert f"--kara-{name.replace('_', '-')}" in str(e.value)


def test_frozen():
    cfg = KaraConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.options.window = 3


def test_prefixed_split_and_unknown_option():
    cfg, rest = KaraConfig.from_prefixed(
        {"kara_window": 64, "kara_buffer": 8, "kara_chunk_budget": 4, "model_path": "x"}
    )
    assert cfg.options.window == 64 and rest == {"model_path": "x"}
    with pytest.raises(KaraConfigError, match="--kara-windw"):
        KaraConfig.from_prefixed({"kara_windw": 64})


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--kara-retention", "1.5"], "--kara-retention"),
        (["--kara-window", "abc"], "--kara-window"),
        (["--kara-window", "64", "--kara-buffer", "64"], "--kara-buffer"),
        (
            [
                "--kara-window",
                "64",
                "--kara-buffer",
                "8",
                "--kara-retention",
                "0.1",
                "--kara-chunk-budget",
                "6",
            ],
            "--kara-chunk-budget",
        ),
        (["--kara-max-chunk", "2"], "--kara-max-chunk"),
        (["--kara-policy", "h3o"], "--kara-policy"),
        (["--kara-snapkv-budget", "300"], "--kara-snapkv-budget"),
    ],
)
def test_launcher_rejects_bad_flags_in_process(argv, needle, capsys):
    from support import PROXY_MODEL

    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", PROXY_MODEL, *argv])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert needle in err, err


def test_launcher_process_exits_nonzero_naming_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_kara.launch_server", "--kara-retention", "1.5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "--kara-retention" in proc.stderr and "(0, 1]" in proc.stderr


@pytest.mark.parametrize(
    "device, ring, ram, gpu, want",
    [
        (
            "cpu",
            400 << 20,
            20 << 30,
            None,
            "capture",
        ),  # CPU: compute-bound, a ring well within RAM
        (
            "cpu",
            380 << 20,
            20 << 30,
            None,
            "capture",
        ),  # SmolLM2 default server: 0.37 GiB beside a 0.35 GiB pool
        (
            "cpu",
            8 << 30,
            20 << 30,
            None,
            "recompute",
        ),  # CPU: ring over 25% of the available RAM
        (
            "cuda",
            None,
            20 << 30,
            80 << 30,
            "recompute",
        ),  # CUDA, request limit unknown (SGLang's default)
        (
            "cuda",
            16 << 30,
            20 << 30,
            80 << 30,
            "recompute",
        ),  # CUDA: ring per slot, 8B model
        (
            "cuda",
            1 << 30,
            20 << 30,
            80 << 30,
            "capture",
        ),  # CUDA: a few running requests
    ],
)
def test_auto_query_source_by_device(device, ring, ram, gpu, want):
    from sgl_kara.startup import choose_query_source

    assert choose_query_source(device, ring, ram, gpu) == want


def test_capture_ring_rows_are_bounded_by_the_pool(monkeypatch):
    """One ring row per request that can run at once: the request limit, bounded by what the pool
    holds at one ring row's worth of tokens each (a run with --max-running 256 on a 4k-token pool
    used to size 257 rows); ``--kara-query-ring-rows`` caps it further. ``auto`` judges the ring
    it would allocate against the RAM share: capture while it fits, recompute past it (a cap is
    then dropped: it is refused with recompute)."""
    import types

    from sgl_kara import startup as support
    from sgl_kara.memory_plan import CPU_RING_SHARE
    from sgl_kara.model_shape import ModelShape, ring_rows

    assert (
        ring_rows(8, 8192, 640) == 8
    )  # SmolLM2 default server: the request limit binds
    assert ring_rows(256, 4300, 160) == 27  # ceil(4300 / 160): the pool binds
    assert ring_rows(256, 160, 160) == 1 and ring_rows(256, 1, 160) == 1
    assert (
        ring_rows(256, None, 160) == 256
    )  # pool unknown (CUDA before SGLang sizes it)
    assert ring_rows(256, 4300, 160, 16) == 16 and ring_rows(8, 4300, 160, 16) == 8
    cfg = KaraConfig.build(window=128, buffer=8, period=32)
    cap = cfg.query_ring_capacity
    assert cap == 160
    gqa3 = ModelShape(
        layers=4,
        q_heads=12,
        kv_heads=4,
        head_dim=32,
        context_len=4096,
        checkpoint_dtype="float32",
        weight_file_bytes=1 << 20,
    )
    args = types.SimpleNamespace(
        max_running_requests=256, max_total_tokens=4300, dtype="float32", device="cpu"
    )
    ring27 = gqa3.ring_bytes(
        27, cap, 4
    )  # what auto judges: the pool-bounded ring, not 256 rows
    monkeypatch.setattr(
        support, "available_ram_bytes", lambda: int(ring27 / CPU_RING_SHARE) + 1
    )
    assert support.resolve_query_source(cfg, args, gqa3).query_source == "capture"
    monkeypatch.setattr(
        support, "available_ram_bytes", lambda: int(ring27 / CPU_RING_SHARE) - 1
    )
    assert support.resolve_query_source(cfg, args, gqa3).query_source == "recompute"
    capped = support.resolve_query_source(
        dataclasses.replace(cfg, query_ring_rows=16), args, gqa3
    )
    assert (capped.query_source, capped.query_ring_rows) == (
        "capture",
        16,
    )  # 16 rows fit where 27 did not
    monkeypatch.setattr(support, "available_ram_bytes", lambda: 0)
    none = support.resolve_query_source(
        dataclasses.replace(cfg, query_ring_rows=16), args, gqa3
    )
    assert (none.query_source, none.query_ring_rows) == ("recompute", 0)


def test_query_ring_rows_is_validated():
    with pytest.raises(KaraConfigError, match=r"--kara-query-ring-rows.*\[0, 65536\]"):
        KaraConfig.build(query_ring_rows=-1)
    with pytest.raises(KaraConfigError, match=r"--kara-query-ring-rows.*not recompute"):
        KaraConfig.build(query_source="recompute", query_ring_rows=4)
    assert (
        KaraConfig.build(query_source="capture", query_ring_rows=4).to_dict()[
            "query_ring_rows"
        ]
        == 4
    )
