"""Fixtures: tiny seeded models, engines shared per configuration, a server per module.

An engine takes ~5 s to start on 2 cores (its processes forked from tests/engine_forkserver.py's
server; 10-30 s spawned), so tests that can share one do: ``engines`` starts
an engine per configuration (kind, model, environment, options) and hands the same one to every
test that asks for it while it lives; ``server`` is a module's server, started with the module's
``server_args``. Helpers live in
tests/support.py (imported by name); importing it sets the test environment (Triton's
interpreter, SGLang's strict memory checks for every engine the tests start).
"""

from __future__ import annotations

import os
import sys

# KARA_TEST_PATCHED_SGLANG=1: the session runs on SGLang with the upstream series applied
# (patches/upstream; tests/patched_sglang.py), before anything imports SGLang: the patched tree
# first on this process's path and on every child's (engines, servers, the fork server).
if os.environ.get("KARA_TEST_PATCHED_SGLANG") == "1":
    import patched_sglang

    _TREE = patched_sglang.build()
    sys.path.insert(0, str(_TREE / "python"))
    os.environ["PYTHONPATH"] = patched_sglang.env(_TREE)["PYTHONPATH"]

import pytest  # noqa: E402
import support  # noqa: E402
from support import (  # noqa: F401, E402  (names tests/gpu_checks.py and some test files import from here)
    PROXY_MODEL,
    Server,
    engine_env,
    flush_when_idle,
    free_port,
    start_engine,
)
from support import release_tasks_on_shutdown as _release_tasks_on_shutdown  # noqa: F401, E402
from support import track as _track  # noqa: F401, E402

# Small engines: a bounded KV pool, few requests; SGLang's overlap scheduler on (its default), as
# for users: compression runs under it (tests/test_overlap.py compares with it off).
ENGINE_COMMON = dict(
    max_total_tokens=16384,
    max_running_requests=16,
    log_level="error",
    random_seed=0,
)


def pytest_configure(config):
    support.PYTEST_CONFIG = config


@pytest.fixture(autouse=True)
def sglang_variables_do_not_outlive_a_test():
    """SGLang's ServerArgs writes ``SGLANG_*`` variables into the process that builds it: a test's
    SGLang and OpenMP variables are put back as they were after it, so that every engine starts
    under the test process's own (the engines' fork server compares them,
    tests/engine_forkserver.py)."""
    import os

    from engine_forkserver import sglang_and_omp_variables

    saved = sglang_and_omp_variables()
    yield
    for name in set(sglang_and_omp_variables()) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from bench.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from bench.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=2))


class EnginePool:
    """Live engines, one per configuration, handed to every test that asks for the same one.

    At most ``keep`` live at once (the least recently used one is stopped for a new one). Each is
    stopped alone (``support.stop_engine``), since SGLang 0.5.23's ``Engine.shutdown`` kills every
    child of the process; for the same reason the pool is closed before any engine a test starts
    itself (``support.start_engine``) and before that engine's shutdown. An engine is handed out
    idle with its radix cache flushed; a test that changes an engine beyond its own requests
    (weights, retraction settings) starts its own instead.
    """

    def __init__(self, keep: int = 3):
        self.keep = keep
        self.live: dict[tuple, object] = {}  # in order of last use
        self.starts = 0

    def __call__(self, kind: str, model_path: str, env: dict | None = None, **options):
        key = (
            kind,
            model_path,
            tuple(sorted((env or {}).items())),
            tuple(sorted(options.items())),
        )
        engine = self.live.pop(key, None)
        if engine is None:
            while len(self.live) >= self.keep:
                support.stop_engine(self.live.pop(next(iter(self.live))))
            with engine_env(**(env or {})):
                engine = support.start_engine(kind, model_path, shared=True, **options)
            self.starts += 1
        else:
            assert flush_when_idle(engine), (
                "a shared engine still holds slots after its last test"
            )
        self.live[key] = engine
        from sgl_kara.plugin import set_serving_policy

        config = getattr(engine, "kara_config", None)
        set_serving_policy(
            config.policy if config is not None else "none"
        )  # this engine's request checks
        return engine

    def close(self) -> None:
        engines, self.live = list(self.live.values()), {}
        for engine in engines:
            support.stop_engine(engine)


@pytest.fixture(scope="session")
def engines():
    """``engines(kind, model_path, env=None, **options)``: the live engine of that configuration,
    started if it is not the one alive (EnginePool)."""
    pool = EnginePool()
    support.SHARED_ENGINES.append(pool)
    yield pool
    support.SHARED_ENGINES.remove(pool)
    pool.close()


@pytest.fixture(scope="module")
def server(request):
    """The module's server: ``python -m sgl_kara.launch_server`` started with what the module's own
    ``server_args`` fixture returns (``{"args": [...], "env": {...}, "timeout": s}``; env and
    timeout optional), shared by the module's tests and stopped after them."""
    spec = request.getfixturevalue("server_args")
    srv = Server(spec["args"], timeout=spec.get("timeout", 240), env=spec.get("env"))
    yield srv
    srv.stop()
