"""The installed SGLang with the upstream series (patches/upstream/) applied, for tests.

build()          a tree ``<dir>/python/sglang`` copied from the installed SGLang with every
                 patch applied in order (``git apply``) and each patch's unit tests under
                 ``<dir>/test/registered/unit/``; built once per series digest (the patches'
                 bytes and SGLang's version) in a cache directory under $KARA_CACHE (default:
                 the system's temp directory), built again when a patch changes
check()          ``git apply --check`` of each patch in order, each applied before the next is
                 checked, on a fresh copy of only the files the series touches: None, or the
                 first patch that fails and git's reason
env(dir)         this process's environment with ``<dir>/python`` first on PYTHONPATH: a
                 process started with it imports the patched SGLang (the installed
                 distributions' entry points, sgl_kara's plugin among them, still load)

python -m tests.patched_sglang --check            exit 1 naming the first patch that fails
python -m tests.patched_sglang --build            print the patched tree's directory
python -m tests.patched_sglang --generate MODEL OUT
                 a plain ``sglang.Engine`` greedy run on MODEL with whatever SGLang this
                 interpreter imports; OUT (JSON): the SGLang file imported, whether SGLang
                 loaded sgl_kara's plugin, each output's token ids and meta_info keys
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERIES_DIR = ROOT / "patches" / "upstream"
_DIFF_LINE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def series() -> list[Path]:
    """The series' patch files, in order (``NNNN-slug.patch``)."""
    return sorted(SERIES_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def installed_sglang() -> Path:
    """The installed SGLang's package directory (site-packages/sglang), whatever PYTHONPATH says."""
    return Path(importlib.metadata.distribution("sglang").locate_file("sglang"))


def touched(patch: Path) -> list[str]:
    """Repository paths the patch changes or creates (``python/sglang/...``, ``test/...``)."""
    return [m.group(1) for m in _DIFF_LINE.finditer(patch.read_text())]


def test_files(patch: Path) -> list[str]:
    """The unit-test files the patch adds or changes (SGLang's layout)."""
    return [p for p in touched(patch) if p.startswith("test/registered/unit/")]


def digest() -> str:
    """What a built tree depends on: SGLang's version and every patch, name and bytes."""
    h = hashlib.sha256(importlib.metadata.version("sglang").encode())
    for patch in series():
        h.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("KARA_CACHE") or tempfile.gettempdir()
    return Path(base) / "sgl_kara_patched_sglang"


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # GIT_DIR unset: git resolves the tree from cwd (a fresh `git init` there).
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def _apply_all(tree: Path) -> str | None:
    """Apply the series in order on ``tree`` (a fresh ``git init`` directory): None, or
    "<patch>: <git's reason>" for the first patch whose ``git apply --check`` fails."""
    for patch in series():
        checked = _git(tree, "apply", "--check", str(patch))
        if checked.returncode != 0:
            return f"{patch.name}: {checked.stderr.strip()}"
        applied = _git(tree, "apply", str(patch))
        if applied.returncode != 0:
            return f"{patch.name}: {applied.stderr.strip()}"
    return None


def check() -> str | None:
    """``git apply --check`` of each patch in order on a fresh copy of the files the series
    touches (each patch applied before the next is checked): None, or the first failure."""
    source = installed_sglang()
    with tempfile.TemporaryDirectory(prefix="sgl_kara_series_check_") as tmp:
        tree = Path(tmp)
        for path in {p for patch in series() for p in touched(patch)}:
            if path.startswith("python/sglang/"):
                src = source / path.removeprefix("python/sglang/")
                if src.is_file():
                    (tree / path).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, tree / path)
        _git(tree, "init", "-q")
        return _apply_all(tree)


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build() -> Path:
    """The patched tree for the current series (built now if the cache lacks it)."""
    root = cache_root()
    tag = digest()
    final = root / f"sglang-{tag}"
    if (final / "READY").is_file():
        return final
    with _locked(root / ".lock"):
        if (final / "READY").is_file():
            return final
        work = root / f".build-{tag}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        # __pycache__ comes along: Python revalidates each .pyc against its source's mtime and
        # size, so only the patched modules compile again.
        shutil.copytree(installed_sglang(), work / "python" / "sglang", symlinks=True)
        _git(work, "init", "-q")
        failed = _apply_all(work)
        if failed is not None:
            shutil.rmtree(work, ignore_errors=True)
            raise RuntimeError(f"the upstream series does not apply: {failed}")
        (work / "READY").write_text(tag + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(work, final)
        for stale in root.glob("sglang-*"):  # earlier series' trees
            if stale != final:
                shutil.rmtree(stale, ignore_errors=True)
    return final


def env(tree: Path, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with ``<tree>/python`` first on PYTHONPATH."""
    out = dict(os.environ if base is None else base)
    rest = out.get("PYTHONPATH")
    out["PYTHONPATH"] = str(tree / "python") + (os.pathsep + rest if rest else "")
    return out


def generate_probe(model: str, out: str) -> None:
    """A plain ``sglang.Engine`` (nothing of sgl_kara asked for) on ``model``: greedy output ids of
    a few prompts, written with which SGLang this interpreter imported."""
    import sglang
    import torch

    from sgl_kara.cpu.server import cpu_defaults
    from sgl_kara.engine import shutdown_cleanly

    options = {} if torch.cuda.is_available() else cpu_defaults()
    engine = sglang.Engine(
        model_path=model,
        max_total_tokens=2048,
        max_running_requests=4,
        log_level="error",
        random_seed=0,
        **options,
    )
    try:
        outs = engine.generate(
            input_ids=[[1, 5, 9, 2 + i, 17, 4 * i + 3] for i in range(3)],
            sampling_params={
                "max_new_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    finally:
        shutdown_cleanly(engine)
    record = {
        "sglang_file": sglang.__file__,
        "plugin_loaded": "sgl_kara.plugin" in sys.modules,
        "output_ids": [o["output_ids"] for o in outs],
        "meta_info_keys": [sorted(o["meta_info"]) for o in outs],
    }
    Path(out).write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.patched_sglang")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--check", action="store_true", help="git apply --check, in order"
    )
    mode.add_argument("--build", action="store_true", help="print the patched tree")
    mode.add_argument("--generate", nargs=2, metavar=("MODEL", "OUT"))
    args = parser.parse_args(argv)
    if args.check:
        patches = series()
        if not patches:
            print(f"no patches in {SERIES_DIR}", file=sys.stderr)
            return 1
        failed = check()
        if failed is not None:
            print(f"upstream series: {failed}", file=sys.stderr)
            return 1
        print(f"upstream series: {len(patches)} patches apply in order")
        return 0
    if args.build:
        print(build())
        return 0
    generate_probe(*args.generate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
