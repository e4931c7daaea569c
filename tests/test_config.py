"""KaraConfig validation and the launcher's refusal of bad flags (before any model loads)."""

import subprocess
import sys

import pytest

from sgl_kara.config import KaraConfig, KaraConfigError, kept_count


def test_defaults_are_valid_and_documented():
    cfg = KaraConfig()
    assert cfg.policy == "kara" and cfg.window == 512 and cfg.buffer == 32
    assert cfg.kept_per_window == kept_count(480, 0.25) == 120
    assert cfg.chunk_budget < cfg.kept_per_window


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
        (dict(policy="h2o"), "policy"),
        (dict(query_source="magic"), "query_source"),
        (dict(period=0), "period"),
        (dict(max_seqs=0), "max_seqs"),
        (dict(window="big"), "window"),
        (dict(retention="0.5"), "retention"),
        (dict(period=True), "period"),
        (dict(snapkv_budget=2000, snapkv_threshold=1500), "snapkv_threshold"),
        (dict(snapkv_kernel=4), "snapkv_kernel"),
        (dict(scoring="buffer", buffer=0), "buffer"),
    ],
)
def test_invalid_values_name_the_flag(kwargs, name):
    with pytest.raises(KaraConfigError) as e:
        KaraConfig(**kwargs)
    assert e.value.name == name
    assert f"--kara-{name.replace('_', '-')}" in str(e.value)


def test_frozen():
    cfg = KaraConfig()
    with pytest.raises(Exception):
        cfg.window = 3


def test_prefixed_split_and_unknown_option():
    cfg, rest = KaraConfig.from_prefixed({"kara_window": 64, "kara_buffer": 8, "kara_chunk_budget": 4, "model_path": "x"})
    assert cfg.window == 64 and rest == {"model_path": "x"}
    with pytest.raises(KaraConfigError, match="--kara-windw"):
        KaraConfig.from_prefixed({"kara_windw": 64})


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--kara-retention", "1.5"], "--kara-retention"),
        (["--kara-window", "abc"], "--kara-window"),
        (["--kara-window", "64", "--kara-buffer", "64"], "--kara-buffer"),
        (["--kara-window", "64", "--kara-buffer", "8", "--kara-retention", "0.1", "--kara-chunk-budget", "6"],
         "--kara-chunk-budget"),
        (["--kara-max-chunk", "2"], "--kara-max-chunk"),
        (["--kara-policy", "h2o"], "--kara-policy"),
        (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
        (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
        (["--dp-size", "2"], "--dp-size"),
        (["--pp-size", "2"], "--pp-size"),
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    ],
)
def test_launcher_rejects_bad_flags_in_process(argv, needle, capsys):
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert needle in err, err


def test_launcher_process_exits_nonzero_naming_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_kara.launch_server", "--kara-retention", "1.5"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "--kara-retention" in proc.stderr and "(0, 1]" in proc.stderr
