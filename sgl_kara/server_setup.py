"""Server args of a sgl_kara server, as the launcher and ``sgl_kara.Engine`` build them:
sgl_kara's defaults where the user set none, the refusals and resolved KaraConfig of start-up
(startup.py), and, where the server runs on a CPU, the CPU serving kit's settings, RAM check and
thread binding (sgl_kara/cpu/server.py). A server on a GPU imports nothing of the kit."""

from __future__ import annotations

import functools
import sys

from sgl_kara import startup
from sgl_kara.config import KaraConfig

# The model a refusal names where no default model is served (docs/GPU.md plans for it).
EXAMPLE_GPU_MODEL = "Qwen/Qwen3-8B"


def device_of(given: dict) -> str:
    """The device a server runs on: the user's ``device``, else CUDA where there is one."""
    return given.get("device") or ("cuda" if startup.cuda_available() else "cpu")


def default_model_path(device: str, flag: str = "--model-path") -> str:
    """The model served without a model path: on a CPU, the CPU serving kit's SmolLM2-135M-Instruct,
    converted once (sgl_kara/cpu/smollm2.py); on any other device none. Raises
    UnsupportedFeature with one line: on a GPU, pass ``flag``; on a CPU, the install commands
    of what the default model lacks."""
    if device != "cpu":
        example = (
            f"{flag} {EXAMPLE_GPU_MODEL}"
            if flag.startswith("--")
            else f'{flag}="{EXAMPLE_GPU_MODEL}"'
        )
        raise startup.UnsupportedFeature(
            f"no default model on {device}: pass {flag} (e.g. {example}); the default "
            "model, SmolLM2-135M-Instruct, is the CPU serving kit's"
        )
    from sgl_kara.cpu.smollm2 import DefaultModelMissing
    from sgl_kara.cpu.smollm2 import default_model_path as smollm2

    try:
        return smollm2()
    except DefaultModelMissing as e:
        raise startup.UnsupportedFeature(str(e)) from None


def server_defaults(model_path: str, given: dict, compressing: bool = False) -> dict:
    """Server args sgl_kara sets when the user did not (``given``: the ServerArgs fields the
    user set, with their values): on a CPU the kit's (cpu/server.py; ``compressing``: a
    compressing server); on a GPU none, SGLang's own defaults apply."""
    if device_of(given) != "cpu":
        return {}
    from sgl_kara.cpu.server import server_defaults as cpu_server_defaults

    return cpu_server_defaults(model_path, given, compressing)


def prepare(server_args, cfg: KaraConfig) -> KaraConfig:
    """Refusals and resolution (startup.prepare_server_args), then on a CPU the RAM check and
    the cores of each scheduler rank. Returns the resolved config."""
    cfg = startup.prepare_server_args(server_args, cfg)
    if startup.serving_device(server_args) == "cpu":
        from sgl_kara.cpu import server as cpu_server

        cpu_server.check_memory(server_args, cfg)
        cpu_server.threads_bind(server_args)
    return cfg


def scheduler_process(cfg: KaraConfig):
    """SGLang's scheduler process function for a compressing server (its
    ``run_scheduler_process_func``): ``run_scheduler_process`` with this config."""
    return functools.partial(run_scheduler_process, kara_config=cfg.to_dict())


def check_sglang() -> None:
    """The installed SGLang is the release sgl_kara is made for (checked before any of its
    modules is imported), it has the whole upstream series or none of it (the one backend of
    this process, chosen here: sgl_kara.backends), and every SGLang callable a serving process
    here hooks or overrides is there with its pinned signature (``pinned_callables``): else UnsupportedSGLang, one line.
    Run by the launcher, ``sgl_kara.Engine`` and Kara's scheduler process function; never by the
    plugin, so plain SGLang with sgl_kara installed starts whatever its version."""
    startup.check_sglang_version()
    startup.check_backend()
    startup.check_pins(pinned_callables())


def pinned_callables() -> dict[str, tuple[str, str]]:
    """The core's hook targets and overrides (those of an extension point where SGLang has it)
    and, where a serving process here registers the CPU kit's hooks, the kit's hook targets:
    path -> (pinned signature, "hook" | "override"). A GPU server imports nothing of the kit."""
    from sgl_kara import _sglang as adapter
    from sgl_kara.plugin import registers_cpu_kit

    pinned = adapter.pins()
    if registers_cpu_kit():
        from sgl_kara.cpu import _sglang as kit

        pinned.update(kit.pins())
    return pinned


def run_scheduler_process(*args, kara_config: dict, **kwargs):
    """A compressing server's scheduler process: the installed SGLang checked in this process
    first (``check_sglang``: one line on stderr and exit status 2 under another release, before
    SGLang's scheduler module is imported, or where a pinned callable differs), then Kara's
    scheduler."""
    try:
        check_sglang()
    except startup.UnsupportedSGLang as e:
        print(f"sgl_kara: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    from sgl_kara.scheduler.kara_scheduler import run_kara_scheduler_process

    return run_kara_scheduler_process(*args, kara_config=kara_config, **kwargs)
