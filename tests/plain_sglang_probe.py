"""Run as a script by tests/test_plain_sglang.py (a fresh interpreter, so nothing an earlier test
did in the test process counts): ``python plain_sglang_probe.py MODEL OUT``. Starts, one after
the other, plain ``sglang.Engine`` (nothing of sgl_kara asked for), plain ``sglang.Engine`` with
``KARA_CPU_KERNELS=1``, and ``sgl_kara.Engine(kara_policy="none")``, and writes OUT/<case>.json:
what sgl_kara attached to SGLang in each of its processes, read from SGLang's own objects.

    main          this process, after the engine started
    scheduler     read inside the scheduler process when the test asks for /server_info: the
                  probe's own AFTER hook on ``Scheduler.get_internal_state`` (registered before
                  SGLang loads its plugins there) adds it to SGLang's internal-state answer
    detokenizer   read in the detokenizer process right after SGLang loaded its plugins there

Each process reports the sgl_kara hooks in SGLang's HookRegistry that are applied
(``sgl_kara_hooks``), independently the SGLang callables named in sgl_kara/_sglang.py whose
installed object wraps a function of sgl_kara (``wrapped``), RoPE's CPU flag, whether the radix
backend "kara" is registered, and whether SGLang loaded sgl_kara's plugin module at all.
"""

from __future__ import annotations

import inspect
import json
import os
import pkgutil
import sys


def _wraps_sgl_kara(obj) -> bool:
    """A HookRegistry wrapper (``__wrapped__``) whose closure holds a function of sgl_kara."""
    while obj is not None and hasattr(obj, "__wrapped__"):
        for cell in getattr(obj, "__closure__", None) or ():
            value = cell.cell_contents
            if getattr(value, "__module__", "").startswith("sgl_kara") and callable(
                value
            ):
                return True
        obj = obj.__wrapped__
    return False


def hook_state() -> dict:
    from sglang.srt.layers.rotary_embedding import base as rope
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_kara import _sglang as adapter
    from sgl_kara.cpu import _sglang as kit

    hooks = sorted(
        f"{target} <- {hook.__module__}.{hook.__qualname__}"
        for target, entries in HookRegistry._hooks.items()
        if target in HookRegistry._patched
        for _, hook, _ in entries
        if getattr(hook, "__module__", "").startswith("sgl_kara")
    )
    wrapped = []
    for path in {**adapter.SIGNATURES, **kit.SIGNATURES}:
        owner_path, _, name = path.rpartition(".")
        owner = pkgutil.resolve_name(owner_path)
        obj = (
            inspect.getattr_static(owner, name)
            if inspect.isclass(owner)
            else getattr(owner, name)
        )
        obj = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
        replaced = inspect.isclass(obj) and obj.__module__.startswith("sgl_kara")
        if replaced or _wraps_sgl_kara(obj):
            wrapped.append(path)
    return {
        "pid": os.getpid(),
        "sgl_kara_hooks": hooks,
        "wrapped": sorted(wrapped),
        "rope_cpu": bool(rope._is_cpu),
        "kara_radix_backend": "kara" in registered_radix_cache_backends(),
        "plugin_loaded": "sgl_kara.plugin" in sys.modules,
        "KARA_SERVE": os.environ.get("KARA_SERVE"),
    }


def _report(result, scheduler, recv_req):
    result.internal_state["probe"] = hook_state()
    return result


def probe_scheduler(*args, **kwargs):
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        _report,
        HookType.AFTER,
    )
    return run_scheduler_process(*args, **kwargs)


def probe_detokenizer(*args, **kwargs):
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what run_detokenizer_process does first (idempotent)
    with open(os.path.join(os.environ["PROBE_OUT"], "detokenizer.json"), "w") as f:
        json.dump(hook_state(), f)
    return run_detokenizer_process(*args, **kwargs)


def run(case: str, engine_class, model: str, out: str, **options) -> None:
    from sgl_kara.cpu.server import cpu_defaults
    from sgl_kara.engine import shutdown_cleanly

    class Probed(engine_class):
        run_scheduler_process_func = staticmethod(probe_scheduler)
        run_detokenizer_process_func = staticmethod(probe_detokenizer)

    os.environ["PROBE_OUT"] = out
    engine = Probed(
        model_path=model,
        **cpu_defaults(),
        max_total_tokens=2048,
        max_running_requests=4,
        disable_overlap_schedule=True,
        log_level="error",
        random_seed=0,
        **options,
    )
    try:
        main = hook_state()
        outs = engine.generate(
            [f"Question {i}: what is {i} plus {i}?" for i in range(4)],
            {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        internal = engine.get_server_info()["internal_states"][0]
    finally:
        shutdown_cleanly(engine)
    with open(os.path.join(out, "detokenizer.json")) as f:
        detokenizer = json.load(f)
    record = {
        "main": main,
        "scheduler": internal["probe"],
        "detokenizer": detokenizer,
        "kara_cpu_kernels": internal.get("kara_cpu_kernels"),
        "completion_tokens": [o["meta_info"]["completion_tokens"] for o in outs],
    }
    with open(os.path.join(out, f"{case}.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    from sglang.srt.entrypoints.engine import (
        Engine as SGLangEngine,
    )  # what sglang.Engine names

    import sgl_kara

    model, out = sys.argv[1:3]
    run("plain", SGLangEngine, model, out)
    os.environ["KARA_CPU_KERNELS"] = "1"  # plain SGLang opting into the CPU kernels
    run("plain_cpu_kernels", SGLangEngine, model, out)
    del os.environ["KARA_CPU_KERNELS"]
    run("sgl_kara", sgl_kara.Engine, model, out, kara_policy="none")
