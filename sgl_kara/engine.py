"""``sgl_kara.Engine``: ``sglang.Engine`` plus ``kara_*`` keyword options.

    engine = sgl_kara.Engine(model_path=..., kara_policy="kara", kara_retention=0.25)

Without CUDA the CPU defaults (device cpu, torch_native attention, page size 1) apply and without
``model_path`` the CPU serving kit's default model is served; on a GPU ``model_path`` is required.
``kara_policy="none"`` is SGLang's scheduler with sgl_kara's request checks and CPU kernels. The processes the Engine starts serve
with sgl_kara (``KARA_SERVE=1`` while it starts them; sgl_kara/plugin.py). Under another SGLang
release than the one sgl_kara is made for, or one where a callable sgl_kara hooks or overrides is
missing or has another signature, it refuses at once (server_setup.check_sglang).

SGLang starts its workers by spawn, which runs the calling script again in each of them: a script
that creates an Engine must do so under ``if __name__ == "__main__":`` (checked before anything
starts: ``check_main_guard``).
"""

from __future__ import annotations

import ast
import os
import sys

from sgl_kara import startup

try:
    from sgl_kara._sglang import SGLangEngine
except ImportError:
    # another SGLang release's modules: its one line rather than the import's error
    startup.check_sglang_version()
    raise
from sgl_kara.config import KaraConfig
from sgl_kara.plugin import serving
from sgl_kara.server_setup import (
    check_sglang,
    default_model_path,
    device_of,
    prepare,
    server_defaults,
)


def build_server_args(kwargs: dict):
    """Split ``kara_*`` options off ``kwargs``; returns (resolved KaraConfig, ServerArgs)."""
    from sgl_kara._sglang import ServerArgs

    cfg, rest = KaraConfig.from_prefixed(kwargs)
    if rest.get("model_path") is None:
        rest["model_path"] = default_model_path(device_of(rest), "model_path")
    for key, value in server_defaults(rest["model_path"], rest, cfg.enabled).items():
        rest.setdefault(key, value)
    rest.setdefault("log_level", "error")
    server_args = ServerArgs(**rest)
    cfg = prepare(server_args, cfg)
    return cfg, server_args


def release_loop_tasks(engine) -> None:
    """Cancel the event-loop tasks of a shut-down engine's TokenizerManager.

    Defensive: SGLang 0.5.23's TokenizerManager starts ``handle_loop`` and ``sigterm_watchdog`` on
    the process-wide event loop and ``Engine.shutdown`` leaves them there, so a later Engine in
    the same process runs them; one that raised would reach ``print_exception_wrapper``, which
    kills the whole process tree.
    """
    from sgl_kara import backends

    backends.current().release_loop_tasks(engine)


def shutdown_cleanly(engine, shutdown=None) -> None:
    """The engine's own shutdown, then ``release_loop_tasks`` where SGLang's shutdown leaves the
    tasks (0.5.23; patches/upstream 0009 releases them itself): what ``sgl_kara.Engine.shutdown``
    does, for a plain ``sglang.Engine`` too (benchmarks, tests)."""
    from sgl_kara import _sglang as adapter
    from sgl_kara import backends

    try:
        if shutdown is not None:
            shutdown()
        else:
            adapter.shutdown_engine(engine)
    finally:
        backends.current().release_loop_tasks(engine)


class MainGuardMissing(RuntimeError):
    """An Engine created by a script's top-level code outside ``if __name__ == "__main__":``."""


def _guarded_lines(tree: ast.Module) -> list[tuple[int, int]]:
    """Line ranges of the module's top-level ``if __name__ == "__main__":`` bodies."""
    ranges = []
    for node in tree.body:
        if (
            not isinstance(node, ast.If)
            or not isinstance(node.test, ast.Compare)
            or len(node.test.ops) != 1
        ):
            continue
        sides = [node.test.left, *node.test.comparators]
        names = {s.id for s in sides if isinstance(s, ast.Name)}
        consts = {s.value for s in sides if isinstance(s, ast.Constant)}
        if (
            isinstance(node.test.ops[0], ast.Eq)
            and names == {"__name__"}
            and consts == {"__main__"}
        ):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno))
    return ranges


# psutil derives a process's start from the boot time, which Linux gives in whole seconds: a
# script written just before ``python script.py`` can look up to a second newer than the process.
START_TIME_SLACK_S = 2.0


def _process_start() -> float:
    """When this process started (seconds since the epoch, to about a second)."""
    import psutil

    return psutil.Process().create_time()


def check_main_guard() -> None:
    """Raise ``MainGuardMissing`` when this call runs from the top-level code of the script
    Python started (``python script.py`` / ``python -m module``) outside ``if __name__ ==
    "__main__":``. SGLang starts its scheduler by spawn, which imports that script again in the
    child: an unguarded Engine there starts again while the child bootstraps, the child dies
    ("An attempt has been made to start a new process before the current process has finished its
    bootstrapping phase") and SGLang's parent reports a dead scheduler, a minute later, blaming
    the OOM killer. Interactive sessions, ``python -c``, a package's ``__main__`` (which spawn does
    not run again) and imported modules pass. A script edited since this process started passes
    too: its source no longer describes the code that runs."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if (
        main is None
        or not path
        or spec_name == "__main__"
        or spec_name.endswith(".__main__")
    ):
        return
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:
        return
    try:
        if os.path.getmtime(path) > _process_start() + START_TIME_SLACK_S:
            return
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    if any(a <= line <= b for a, b in _guarded_lines(tree)):
        return
    raise MainGuardMissing(
        f"{path}, line {line}: sgl_kara.Engine is created by the script's top-level code. SGLang starts "
        "its scheduler by spawn, which runs this script again in the new process; put the code that "
        'creates and uses the Engine under `if __name__ == "__main__":` (README, Quick start).'
    )


class Engine(SGLangEngine):
    def __init__(self, **kwargs):
        check_sglang()  # UnsupportedSGLang: one line, what to install
        check_main_guard()
        if "server_args" in kwargs:
            raise TypeError("sgl_kara.Engine takes keyword options, not server_args=")
        # The hooks and the "kara" radix backend before ServerArgs validates --radix-cache-backend;
        # KARA_SERVE=1 for the processes this engine starts (the caller's value after).
        with serving():
            self.kara_config, server_args = build_server_args(kwargs)
            if server_args.device == "cpu":
                from sgl_kara.cpu.threads import prefer_passive_omp

                prefer_passive_omp()  # the scheduler is spawned: it loads torch with this set
            from sgl_kara.plugin import set_serving_policy

            set_serving_policy(self.kara_config.policy)
            if self.kara_config.enabled:
                from sgl_kara.server_setup import scheduler_process

                self.run_scheduler_process_func = scheduler_process(self.kara_config)
            super().__init__(server_args=server_args)

    def shutdown(self):
        shutdown_cleanly(self, super().shutdown)
