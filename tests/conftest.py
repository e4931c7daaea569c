"""Shared fixtures: tiny seeded models, engines and servers shared per session.

An engine takes ~30 s to start on this CPU, so engines are session-scoped and reused.
SGLang's strict memory checks are on for every engine the tests start.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

# Kernel tests need Triton's interpreter on CPU, and Triton reads this when first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

STRICT_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
os.environ.update(STRICT_ENV)

from sgl_kara.models.default import PROXY_MODEL_DIR

PROXY_MODEL = str(PROXY_MODEL_DIR)  # the reasoning proxy: the tests' fast real-weight model

# Small engines: a bounded KV pool, few requests, no overlap (Kara requires it; vanilla matches).
ENGINE_COMMON = dict(
    max_total_tokens=16384,
    max_running_requests=16,
    disable_overlap_schedule=True,
    log_level="error",
    random_seed=0,
)


@contextlib.contextmanager
def engine_env(**extra):
    """Environment for spawning SGLang processes: no Triton interpreter unless asked."""
    saved = dict(os.environ)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from sgl_kara.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from sgl_kara.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=2))


_PYTEST_CONFIG = None
_LIVE_ENGINE_PROCS: dict[int, list] = {}  # id(engine) -> its watched child processes


def _track(engine) -> None:
    _guard_pytest_process()
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    _LIVE_ENGINE_PROCS[id(engine)] = list(getattr(watchdog, "_processes", None) or [])
    shutdown = engine.shutdown

    def shutdown_and_untrack():
        _LIVE_ENGINE_PROCS.pop(id(engine), None)
        shutdown()

    engine.shutdown = shutdown_and_untrack


def pytest_configure(config):
    global _PYTEST_CONFIG
    _PYTEST_CONFIG = config


def _guard_pytest_process():
    """SGLang's SIGQUIT handlers (launch phase, and the running phase one its TokenizerManager
    registers on the event loop) call ``kill_process_tree(os.getpid())``, which SIGKILLs pytest
    itself with all captured output when any child dies: CI then shows only "Killed". In the
    test process, kill the children, print which test was running (bypassing capture), exit 3."""
    import sglang.srt.entrypoints.engine as engine_mod
    import sglang.srt.managers.tokenizer_manager as tm_mod
    from sglang.srt.utils import kill_process_tree

    if getattr(engine_mod.kill_process_tree, "_sgl_kara_guard", False):
        return

    def guarded(pid, include_parent=True, *args, **kwargs):
        if pid != os.getpid() or not include_parent:
            return kill_process_tree(pid, include_parent, *args, **kwargs)
        if all(p.is_alive() for procs in _LIVE_ENGINE_PROCS.values() for p in procs):
            # Every child of every engine still open is alive: the SIGQUIT cannot be about them
            # (defensive; the crash traced in CI was a live engine's children being killed).
            sys.stderr.write("conftest: ignoring a SIGQUIT while every live engine's children are alive\n")
            return None
        kill_process_tree(pid, False, *args, **kwargs)
        capman = _PYTEST_CONFIG and _PYTEST_CONFIG.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
            sys.stderr.write(out[-20000:] + err[-20000:])
        sys.stderr.write(
            f"\nFATAL: an SGLang child process failed during {os.environ.get('PYTEST_CURRENT_TEST')}; "
            "SGLang asked to kill the process tree. Exiting.\n"
        )
        sys.stderr.flush()
        os._exit(3)

    guarded._sgl_kara_guard = True
    engine_mod.kill_process_tree = guarded
    tm_mod.kill_process_tree = guarded


def _release_tasks_on_shutdown(engine) -> None:
    """Vanilla sglang.Engine: the cleanup sgl_kara.Engine.shutdown does."""
    import functools

    from sgl_kara.engine import shutdown_cleanly

    engine.shutdown = functools.partial(shutdown_cleanly, engine, engine.shutdown)


def start_engine(kind: str, model_path: str, **kwargs):
    """kind: 'sglang' (vanilla) or 'kara'."""
    _guard_pytest_process()
    opts = {**ENGINE_COMMON, **kwargs}
    with engine_env():
        if kind == "sglang":
            import sglang

            from sgl_kara.support import cpu_defaults

            engine = sglang.Engine(model_path=model_path, **cpu_defaults(), **opts)
            _release_tasks_on_shutdown(engine)
        else:
            import sgl_kara

            engine = sgl_kara.Engine(model_path=model_path, **opts)
    _track(engine)
    return engine


def flush_when_idle(engine, timeout: float = 30.0) -> bool:
    """engine.flush_cache() until it succeeds: SGLang refuses a flush while its scheduler still
    holds the last (already answered) batch for an iteration or two, which is a race, not a leak.
    A leaked slot fails SGLang's strict idle memory check inside the scheduler instead."""
    deadline = time.time() + timeout
    while True:
        if engine.flush_cache().success:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bench(script: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python bench/<script> *args`` in a child without TRITON_INTERPRET (engines run torch
    attention); fails the test with the script's stderr tail when it exits nonzero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


class Server:
    def __init__(self, args: list[str], timeout: float = 240, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        full_env.update(env or {})
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sgl_kara_server_{self.port}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgl_kara.launch_server", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout):
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout}s; see {self.log.name}")

    def stop(self):
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()
