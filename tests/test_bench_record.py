"""bench/record.py, the run record every benchmark writes beside its results: each field against
an independent source (/proc, git, the command as run, what the launcher resolves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from support import PROXY_MODEL

from bench import record

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_machine_is_read_from_the_system():
    info = record.machine()
    with open("/proc/cpuinfo") as f:
        model = next(
            line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
        )
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert info["cpu"] == model and info["cores"] == os.cpu_count()
    assert abs(info["ram_gib"] - kib / 2**20) < 0.1
    assert (
        info["text"]
        == f"{os.cpu_count()}-core {model}, {kib / 2**20:.0f} GiB, {info['gpu'] or 'CPU only'}"
    )


def test_git_state_names_the_commit_and_whether_the_tree_changed(tmp_path):
    def git(*args):
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD").strip()
    assert record.git_state(str(tmp_path)) == {"commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("two\n")
    assert record.git_state(str(tmp_path)) == {"commit": head, "dirty": True}
    (tmp_path / "untracked.txt").write_text(
        "x\n"
    )  # untracked files do not make a run dirty
    (tmp_path / "a.txt").write_text("one\n")
    assert record.git_state(str(tmp_path)) == {"commit": head, "dirty": False}
    assert record.git_state(str(tmp_path / "nowhere")) == {
        "commit": None,
        "dirty": None,
    }


def test_a_benchmark_run_records_its_command_commit_and_kernel_switches(tmp_path):
    """``python -m bench.scoring_cost ... --out DIR`` (pure numpy, seconds) as a user runs it, with
    the packed CPU linear switched off: run.json has the command as typed, this checkout's commit,
    the switch and the variable, and a start and end time."""
    args = ["--batches", "16,64", "--out", str(tmp_path)]
    env = {**os.environ, "KARA_PACKED_CPU_LINEAR": "0"}
    subprocess.run(
        [sys.executable, "-m", "bench.scoring_cost", *args],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"] == "python -m bench.scoring_cost " + " ".join(args)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert run["git"]["commit"] == (head or None)
    assert (
        run["kernels"]["packed_cpu_linear"] is False
        and run["kernels"]["fast_cpu_decode"] is True
    )
    assert run["kernels"]["environment"]["KARA_PACKED_CPU_LINEAR"] == "0"
    assert run["date"] <= run["finished"] and run["machine"]["cores"] == os.cpu_count()


def test_engine_config_is_the_resolved_config_and_the_server_fields():
    from sgl_kara.config import KaraConfig

    cfg = KaraConfig.build(window=64, buffer=8, retention=0.5)
    sa = types.SimpleNamespace(
        model_path="/m",
        device="cpu",
        page_size=16,
        max_total_tokens=4096,
        disable_overlap_schedule=True,
    )
    got = record.engine_config(types.SimpleNamespace(kara_config=cfg, server_args=sa))
    assert (
        got["kara"]["window"] == 64
        and got["kara"]["retention"] == 0.5
        and got["kara"]["policy"] == "kara"
    )
    assert KaraConfig.build(**got["kara"]) == cfg  # the record rebuilds the config
    assert (
        got["server"]["page_size"] == 16 and got["server"]["max_total_tokens"] == 4096
    )
    assert (
        set(got["server"]) == set(record.SERVER_FIELDS)
        and got["server"]["tp_size"] is None
    )
    plain = record.engine_config(
        types.SimpleNamespace(server_args=sa)
    )  # sglang.Engine: no Kara
    assert plain["kara"] == {"policy": "none"}


def test_server_config_is_what_the_launcher_resolves():
    """The launcher's own parse: the flags given, the defaults it fills in (the request phase, the
    query source it resolves from ``auto``, the CPU sizing)."""
    got = record.server_config(
        [
            "--model-path",
            PROXY_MODEL,
            "--kara-window",
            "64",
            "--max-total-tokens",
            "5000",
        ]
    )
    assert got["kara"]["window"] == 64 and got["kara"]["phase"] == "request"
    assert got["kara"]["query_source"] in ("capture", "recompute")
    assert (
        got["server"]["max_total_tokens"] == 5000 and got["server"]["device"] == "cpu"
    )
    assert got["server"]["model_path"] == PROXY_MODEL


def test_configs_of_one_label_are_kept_apart(tmp_path):
    rec = record.RunRecord(str(tmp_path), ["--x"])
    rec.add_config("kara", {"pool": 1})
    rec.add_config("kara", {"pool": 1})  # the same settings again: recorded once
    rec.add_config("kara", {"pool": 2})
    rec.note(requests=3)
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["configs"] == {"kara": {"pool": 1}, "kara #2": {"pool": 2}} and data[
        "notes"
    ] == {"requests": 3}
    assert data["command"].endswith(" --x")
    beside = record.RunRecord.beside(str(tmp_path / "table.md"), [])
    assert Path(beside.path) == tmp_path / "table.run.json" and beside.stamp.startswith(
        "date: 20"
    )


def test_a_results_table_starts_with_its_command_date_and_machine(tmp_path):
    rec = record.RunRecord(str(tmp_path), ["--out", "x y"])
    rec.write_md(str(tmp_path / "t.md"), "| a |\n|---|\n| 1 |\n\n")
    lines = (tmp_path / "t.md").read_text().split("\n")
    assert lines[0] == "command: " + rec.data["command"] and rec.data[
        "command"
    ].endswith(" --out 'x y'")
    assert (
        lines[1] == "date: " + rec.data["date"][:10]
        and lines[2] == "machine: " + rec.data["machine"]["text"]
    )
    assert lines[3:] == [
        "",
        "| a |",
        "|---|",
        "| 1 |",
        "",
    ]  # one newline at the end, whatever the text had


@pytest.mark.parametrize("argv, want", [(["a b", "c"], "'a b' c"), ([], "")])
def test_command_line_quotes_what_needs_it(argv, want):
    assert record.command_line(argv).endswith(want) and record.command_line(
        argv
    ).startswith("python ")


def test_a_package_run_records_the_module_as_typed(tmp_path):
    """``python -m bench.quality`` runs bench.quality.harness as ``__main__``; its record and
    table name the command the user typed (a merge of one empty run: no engine)."""
    (tmp_path / "a.json").write_text(json.dumps({"rows": [], "texts": {}}))
    out = tmp_path / "m"
    args = ["--real", "--merge", str(tmp_path / "a.json"), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.quality", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    typed = "python -m bench.quality " + " ".join(args)
    assert (out / "quality_real.md").read_text().splitlines()[0] == "command: " + typed
    assert json.loads((out / "run.json").read_text())["command"] == typed
