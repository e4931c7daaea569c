"""The test engines' SGLang processes forked from a server that imported SGLang once.

SGLang's Engine starts its scheduler and detokenizer by spawn: each new process imports SGLang,
torch and transformers again, ~15 s on two cores, most of a tiny engine's start. The tests'
engines start them through Python's ``forkserver`` instead: one server process imports those
modules once (``PRELOAD``) and forks every later process from itself. The server never runs a
torch operator, so no OpenMP region precedes a fork (GNU OpenMP is not fork-safe after one): the
state sgl_kara's launcher forks its workers from on CPU (``python -m sgl_kara.launch_server``).

Each child takes the environment of the test process at the moment it is started (a spawned
process inherits it; a fork server's child would otherwise inherit the server's): the parent adds
its environment to the data multiprocessing sends with every process, and the server applies it
in the child before the process's target (SGLang's ``load_plugins`` and sgl_kara's hooks read it
there). The spawn path itself runs where an Engine starts in an interpreter of its own
(tests/test_plain_sglang.py, tests/test_readme_engine.py).

    spawn_as_forkserver()   context: SGLang's ``mp.set_start_method("spawn")`` means forkserver
                            (an engine under other SGLang variables than the server's: spawn)
    forkserver_pid()        the running server's pid (None: not started), which the tests'
                            kill-the-tree guard spares
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.spawn as mp_spawn
import os
import sys

ENV_KEY = "sgl_kara_tests_environ"
# What a scheduler and a detokenizer import first: the server pays for it once.
PRELOAD = [
    "engine_forkserver",  # this module: the child's environment hook, in the server
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sgl_kara.scheduler.kara_scheduler",
]

_original_preparation_data = mp_spawn.get_preparation_data
_original_prepare = mp_spawn.prepare


def _preparation_data(name):
    data = _original_preparation_data(name)
    data[ENV_KEY] = dict(os.environ)
    return data


def _prepare(data):
    environ = data.pop(ENV_KEY, None)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    _original_prepare(data)


# Both sides: the parent adds its environment; the server (which imports this module) and every
# child it forks apply it. A spawned child runs the unpatched prepare, which ignores the key.
mp_spawn.get_preparation_data = _preparation_data
mp_spawn.prepare = _prepare


def forkserver_pid() -> int | None:
    return getattr(mp_forkserver._forkserver, "_forkserver_pid", None)


def _import_environ(environ) -> dict:
    """The variables the server's imports may read and a test may set for an engine, by effect:
    SGLang's (``SGLANG_*``, some read when a module is imported; one set to the value SGLang
    reads when it is unset counts as unset: SGLang's ServerArgs writes several so) and OpenMP's
    (read when torch loads; the waiting policy passive unless set). A variable SGLang does not
    declare in its ``envs`` counts as unset when false. sgl_kara's are read at call time
    (sgl_kara/env.py); the caches' locations SGLang sets itself, alike in every process."""
    from sglang.srt.environ import EnvField, envs

    env = {}
    for name, value in environ.items():
        if name.startswith("SGLANG_"):
            field = getattr(envs, name, None)
            if isinstance(field, EnvField):
                default = field.default() if callable(field.default) else field.default
                try:
                    if field.parse(value) == default:
                        continue
                except ValueError:
                    pass
            elif value.strip().lower() in FALSE_VALUES:  # a flag off by default
                continue
            env[name] = value
        elif name.startswith("OMP_"):
            env[name] = value
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


FALSE_VALUES = ("", "0", "false", "no", "off")


def sglang_and_omp_variables() -> dict:
    """This process's ``SGLANG_*`` and ``OMP_*`` variables."""
    return {k: v for k, v in os.environ.items() if k.startswith(("SGLANG_", "OMP_"))}


# The test process's, as support.py set them: the server imports under them.
_SERVER_VARIABLES = sglang_and_omp_variables()


def _server_alive() -> bool:
    import psutil

    pid = forkserver_pid()
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def spawn_as_forkserver():
    """While an engine starts: SGLang's ``mp.set_start_method("spawn", force=True)`` selects the
    fork server instead (started here if it is not running), the start method spawn again
    afterwards. SGLang reads some variables when a module is imported (``SGLANG_TEST_RETRACT``
    in its scheduler): an engine whose SGLang or OpenMP variables differ from the test process's
    is spawned as SGLang does."""
    environ = _import_environ(os.environ)
    if environ != _import_environ(_SERVER_VARIABLES):
        yield
        return
    original = multiprocessing.set_start_method

    def set_start_method(method, force=False):
        original("forkserver" if method == "spawn" else method, force=force)

    if not _server_alive():
        mp_forkserver.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # Python 3.11's fork server does not take the parent's sys.path before it imports PRELOAD.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            mp_forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    multiprocessing.set_start_method = set_start_method
    try:
        yield
    finally:
        multiprocessing.set_start_method = original
        original("spawn", force=True)
