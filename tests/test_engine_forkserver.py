"""The test engines' fork server (tests/engine_forkserver.py): a process started under it is forked
from the server, with the test process's environment as it was at the start; one started under
other SGLang variables (read by SGLang's modules when imported) is spawned instead."""

from __future__ import annotations

import multiprocessing
import os

from engine_forkserver import forkserver_pid, spawn_as_forkserver


def report_parent_and_variable(queue, name):
    queue.put((os.getppid(), os.environ.get(name)))


def _start_reporting(name: str):
    with spawn_as_forkserver():
        # what SGLang's Engine calls
        multiprocessing.set_start_method("spawn", force=True)
        ctx = multiprocessing.get_context()
        queue = ctx.Queue()
        proc = ctx.Process(target=report_parent_and_variable, args=(queue, name))
        proc.start()
    try:
        return queue.get(timeout=120)
    finally:
        proc.join(timeout=30)
        assert proc.exitcode == 0


def test_a_process_forks_from_the_server_with_the_environment_at_its_start(
    monkeypatch,
):
    monkeypatch.setenv("KARA_FORKSERVER_PROBE", "first")
    parent, value = _start_reporting("KARA_FORKSERVER_PROBE")
    assert parent == forkserver_pid() != os.getpid() and value == "first"
    monkeypatch.setenv("KARA_FORKSERVER_PROBE", "second")  # after the server started
    parent, value = _start_reporting("KARA_FORKSERVER_PROBE")
    assert parent == forkserver_pid() and value == "second"
    assert multiprocessing.get_start_method() == "spawn"  # restored after the start


def test_other_sglang_variables_spawn_the_process(monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    parent, value = _start_reporting("SGLANG_TEST_RETRACT")
    assert parent == os.getpid() and value == "1"
