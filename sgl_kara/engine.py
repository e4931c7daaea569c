"""``sgl_kara.Engine``: ``sglang.Engine`` plus ``kara_*`` keyword options.

    engine = sgl_kara.Engine(model_path=..., kara_policy="kara", kara_retention=0.25)

Without ``model_path`` the embedded default model is served; without CUDA the CPU defaults
(device cpu, torch_native attention, page size 1) apply. ``kara_policy="none"`` is plain SGLang.
"""

from __future__ import annotations

import functools

from sgl_kara._sglang import SGLangEngine
from sgl_kara.config import KaraConfig
from sgl_kara.models.default import default_model_path
from sgl_kara.plugin import register
from sgl_kara.support import prepare_server_args, server_defaults


def build_server_args(kwargs: dict):
    """Split ``kara_*`` options off ``kwargs``; returns (resolved KaraConfig, ServerArgs)."""
    from sgl_kara._sglang import ServerArgs

    cfg, rest = KaraConfig.from_prefixed(kwargs)
    if rest.get("model_path") is None:
        rest["model_path"] = default_model_path()
    for key, value in server_defaults(rest["model_path"], rest).items():
        rest.setdefault(key, value)
    rest.setdefault("log_level", "error")
    server_args = ServerArgs(**rest)
    cfg = prepare_server_args(server_args, cfg)
    return cfg, server_args


def quiesce_watchdog(engine) -> None:
    """Disarm the engine's SubprocessWatchdog before its children are killed.

    Defensive (not shown to be needed on its own): SGLang 0.5.23's ``Engine.shutdown`` stops the
    watchdog with a 2 s join and then SIGKILLs the children; a watchdog still checking after the
    kill would report a crash and SIGQUIT this process. Emptying the watched list first makes a
    late check a no-op. The crash actually traced in CI was another engine's shutdown killing a
    live engine's children: ``Engine.shutdown`` kills every child of the process, so one engine
    per process at a time.
    """
    manager = getattr(engine, "tokenizer_manager", None)
    watchdog = getattr(manager, "_subprocess_watchdog", None)
    if watchdog is None:
        return
    stop_event = getattr(watchdog, "_stop_event", None)
    if stop_event is not None:
        stop_event.set()
    for attr in ("_processes", "_names"):
        watched = getattr(watchdog, attr, None)
        if isinstance(watched, list):
            watched.clear()


def release_loop_tasks(engine) -> None:
    """Cancel the event-loop tasks of a shut-down engine's TokenizerManager.

    Defensive: SGLang 0.5.23's TokenizerManager starts ``handle_loop`` and ``sigterm_watchdog`` on
    the process-wide event loop and ``Engine.shutdown`` leaves them there, so a later Engine in
    the same process runs them; one that raised would reach ``print_exception_wrapper``, which
    kills the whole process tree.
    """
    manager = getattr(engine, "tokenizer_manager", None)
    tasks = [t for t in getattr(manager, "asyncio_tasks", ()) if not t.done()]
    for task in tasks:
        task.cancel()
    loop = getattr(engine, "loop", None)
    if tasks and loop is not None and not loop.is_running() and not loop.is_closed():
        import asyncio

        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    if manager is not None:
        manager.asyncio_tasks.clear()
        manager.event_loop = None


def shutdown_cleanly(engine, shutdown=None) -> None:
    """``quiesce_watchdog``, the engine's own shutdown, then ``release_loop_tasks``: what
    ``sgl_kara.Engine.shutdown`` does, for a plain ``sglang.Engine`` too (benchmarks, tests)."""
    quiesce_watchdog(engine)
    try:
        (shutdown or engine.shutdown)()
    finally:
        release_loop_tasks(engine)


class Engine(SGLangEngine):
    def __init__(self, **kwargs):
        register()  # hooks + radix backend before ServerArgs validates --radix-cache-backend
        if "server_args" in kwargs:
            raise TypeError("sgl_kara.Engine takes keyword options, not server_args=")
        self.kara_config, server_args = build_server_args(kwargs)
        if server_args.device == "cpu":
            from sgl_kara.cpu.threads import prefer_passive_omp

            prefer_passive_omp()  # the scheduler is spawned: it loads torch with this set
        from sgl_kara.plugin import set_serving_policy

        set_serving_policy(self.kara_config.policy)
        if self.kara_config.enabled:
            from sgl_kara.scheduler.kara_scheduler import run_kara_scheduler_process

            self.run_scheduler_process_func = functools.partial(
                run_kara_scheduler_process, kara_config=self.kara_config.to_dict()
            )
        super().__init__(server_args=server_args)

    def shutdown(self):
        shutdown_cleanly(self, super().shutdown)
