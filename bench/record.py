"""The run record a benchmark writes beside its results: what ran, where, from which code.

    rec = RunRecord(out_dir)                  # writes OUT/run.json at once (a crashed run keeps it)
    rec = RunRecord.beside("x/table.md")      # a one-file result: x/table.run.json
    rec.add_engine("kara W=64", engine)       # an engine's resolved settings, once it has started
    rec.add_server("kara", launch_argv)       # a launched server's, resolved as the launcher does
    rec.note(requests=33)                     # anything else the figures depend on

``run.json`` holds:

    date        UTC, ISO 8601, when the run started (``finished`` when it ended, if it did)
    machine     CPU model (/proc/cpuinfo, else lscpu), cores, RAM, GPU (if torch sees one), and
                the same in words (``machine_text``, the ``machine:`` line of result tables)
    git         commit, and whether the working tree had uncommitted changes (``dirty``)
    command     the exact command line (``python -m bench.throughput --grid ...``)
    kernels     the sgl_kara CPU kernel switches in force (sgl_kara/env.py) and every ``KARA_*``
                variable set (they change what plain SGLang runs too)
    configs     per engine or server: the resolved ``KaraConfig`` (``cfg.to_dict()``; ``{"policy":
                "none"}`` for plain SGLang) and the SGLang server arguments in ``SERVER_FIELDS``

Imports nothing from SGLang at module level, so scripts that must run without it (the device
check, bench/gpu_kernels.py) write a record too.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = "run.json"

# SGLang server arguments that decide a benchmark's figures (``ServerArgs`` attributes).
SERVER_FIELDS = (
    "model_path device dtype attention_backend page_size max_total_tokens "
    "max_running_requests chunked_prefill_size disable_overlap_schedule "
    "disable_cuda_graph disable_radix_cache kv_cache_dtype "
    "mem_fraction_static random_seed dp_size tp_size schedule_policy "
    "radix_cache_backend"
).split()


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's ``model name``, else lscpu's ``Model name``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10
        ).stdout
        found = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if found:
            return found.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def ram_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def gpu_name() -> str | None:
    """The first CUDA device's name, or None (also when torch is not importable)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine() -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": ram_gib(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
    }
    info["text"] = machine_text(info)
    return info


def machine_text(info: dict | None = None) -> str:
    """The machine in words: ``2-core Intel(R) Xeon(R) Processor, 24 GiB, CPU only``."""
    info = info or machine()
    mem = f", {info['ram_gib']:.0f} GiB" if info.get("ram_gib") else ""
    return f"{info['cores']}-core {info['cpu']}{mem}, {info['gpu'] or 'CPU only'}"


def git_state(root: str = ROOT) -> dict:
    """{"commit": HEAD or None, "dirty": tracked files changed (None when not a git checkout)}."""

    def git(*args):
        try:
            r = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _typed_module() -> str | None:
    """The module of ``python [options] -m <module>`` as the interpreter was started
    (``sys.orig_argv``): a package's ``__main__`` that runs another module as ``__main__``
    (``python -m bench.quality`` runs bench.quality.harness) keeps the name typed."""
    orig, i = getattr(sys, "orig_argv", []), 1
    while i < len(orig) - 1 and orig[i].startswith("-"):
        if orig[i] == "-m":
            return orig[i + 1]
        i += 2 if orig[i] in ("-X", "-W") else 1
    return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``python -m <module> args`` for a module run, else ``python <script> args``."""
    args = sys.argv[1:] if argv is None else list(argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    typed = _typed_module()
    if typed is not None:
        head = ["python", "-m", typed]
    elif spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        head = [
            "python",
            os.path.relpath(sys.argv[0], ROOT) if sys.argv and sys.argv[0] else "-",
        ]
    return " ".join(head + [shlex.quote(str(a)) for a in args])


def kernel_switches() -> dict:
    """The sgl_kara CPU kernel switches as this process reads them (the engines it starts inherit
    the environment) and every ``KARA_*`` variable set."""
    from sgl_kara import env

    return {
        "fast_cpu_decode": env.fast_cpu_decode(),
        "batched_cpu_decode": env.batched_cpu_decode(),
        "packed_cpu_linear": env.packed_cpu_linear(),
        "environment": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith(env.PREFIX)
        },
    }


def server_fields(server_args) -> dict:
    return {name: getattr(server_args, name, None) for name in SERVER_FIELDS}


def engine_config(engine) -> dict:
    """{"kara": resolved KaraConfig as a dict, "server": SERVER_FIELDS} of a started engine
    (``sgl_kara.Engine``, or a plain ``sglang.Engine``: policy none)."""
    cfg = getattr(engine, "kara_config", None)
    return {
        "kara": cfg.to_dict() if cfg is not None else {"policy": "none"},
        "server": server_fields(engine.server_args),
    }


def server_config(launch_argv: list[str]) -> dict:
    """What ``python -m sgl_kara.launch_server *launch_argv`` resolves to on this machine (the
    launcher's own parse: defaults, CPU sizing, the query source), without starting it."""
    from sgl_kara.launch_server import parse

    cfg, server_args = parse(list(launch_argv))
    return {
        "kara": cfg.to_dict(),
        "server": server_fields(server_args),
        "argv": list(launch_argv),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _plain(value):
    """JSON-safe: tuples to lists, anything else unknown to its string."""
    return json.loads(json.dumps(value, default=str))


class RunRecord:
    """``OUT/run.json``, rewritten whenever something is added."""

    def __init__(self, out_dir: str, argv: list[str] | None = None, name: str = FILE):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, name)
        self.data = {
            "date": _now(),
            "machine": machine(),
            "git": git_state(),
            "command": command_line(argv),
            "kernels": kernel_switches(),
            "configs": {},
        }
        self.write()

    @classmethod
    def beside(cls, path: str, argv: list[str] | None = None) -> RunRecord:
        """The record of a script whose --out is one file: ``results.md`` -> ``results.run.json``."""
        stem = os.path.splitext(os.path.basename(path))[0]
        return cls(
            os.path.dirname(os.path.abspath(path)), argv, name=f"{stem}.run.json"
        )

    @property
    def stamp(self) -> str:
        """The lines a results table carries under its command: date and machine."""
        return (
            f"date: {self.data['date'][:10]}\nmachine: {self.data['machine']['text']}"
        )

    @property
    def header(self) -> str:
        """What a results file starts with: the command, then the stamp, then a blank line."""
        return f"command: {self.data['command']}\n{self.stamp}\n\n"

    def write_md(self, path: str, text: str) -> None:
        """A results table (markdown) at ``path``, under the header."""
        with open(path, "w") as f:
            f.write(self.header + text.rstrip("\n") + "\n")

    def add_engine(self, label: str, engine) -> None:
        self.add_config(label, engine_config(engine))

    def add_server(self, label: str, launch_argv: list[str]) -> None:
        self.add_config(label, server_config(launch_argv))

    def add_config(self, label: str, config: dict) -> None:
        """Under ``label``; a label seen before with other settings (another pool, say) gets
        ``#2``, ``#3``, ...; the same settings again are recorded once."""
        config, configs = _plain(config), self.data["configs"]
        key, n = label, 1
        while key in configs and configs[key] != config:
            n += 1
            key = f"{label} #{n}"
        configs[key] = config
        self.write()

    def note(self, **fields) -> None:
        self.data.setdefault("notes", {}).update(fields)
        self.write()

    def finish(self) -> None:
        self.data["finished"] = _now()
        self.write()

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump(_plain(self.data), f, indent=1)
            f.write("\n")


def stamp() -> str:
    """``date:`` and ``machine:`` lines for a results file written without a RunRecord."""
    return f"date: {datetime.date.today().isoformat()}\nmachine: {machine_text()}"
