"""The ports tests and benchmarks start servers on (bench/ports.py), and a server whose port was
taken before it bound it (tests/support.py's Server): the start fails at once, or moves to another
port, instead of waiting out its timeout against a listener that never answers."""

from __future__ import annotations

import socket
import time

import pytest
from support import Server

from bench import ports, server_start
from bench.server_start import PORT_TAKEN, PortTaken


def _listen(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_free_ports_lie_below_the_ephemeral_range_and_above_sglangs():
    low = ports.ephemeral_low()
    picked = [ports.free_port() for _ in range(20)]
    assert len(set(picked)) == len(picked)  # never handed out twice
    for port in picked:
        assert 30000 < port < low
        assert ports.bindable(port)


def test_a_held_port_is_not_bindable_and_not_handed_out():
    port = ports.free_port()
    with _listen(port):
        assert not ports.bindable(port)
        with pytest.raises(RuntimeError, match=f"no free port in {port}-{port}"):
            ports.free_port(low=port, high=port)
    # once released it binds again, but this process has handed it out already
    assert ports.bindable(port)
    with pytest.raises(RuntimeError, match="no free port"):
        ports.free_port(low=port, high=port)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(path)) == 40000
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768
    with pytest.raises(RuntimeError, match="ephemeral range"):
        ports.free_port(low=30100, high=30000)


FAKE_SERVER = f"""
import http.server, sys, time

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print("ERROR:    [Errno 98] {PORT_TAKEN} ('127.0.0.1', %d): " % port, e, flush=True)
    time.sleep(600)  # as SGLang's server does: it stays up without serving
server.serve_forever()
"""


def test_a_server_whose_port_is_taken_fails_at_once(tmp_path, monkeypatch):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    port = ports.free_port()
    with _listen(port):
        tic = time.time()
        with pytest.raises(PortTaken, match=f"port {port} was taken"):
            Server([], timeout=120, module="fake_server", port=port)
        assert time.time() - tic < 30


def test_a_server_on_a_port_it_picked_moves_to_another_when_that_one_is_taken(
    tmp_path, monkeypatch
):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    taken, free = ports.free_port(), ports.free_port()
    picks = iter([taken, free])
    monkeypatch.setattr(server_start, "free_port", lambda: next(picks))
    with _listen(taken):
        server = Server([], timeout=120, module="fake_server")
    try:
        assert server.port == free
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_benchmark_server_moves_to_another_port_when_its_pick_is_taken(tmp_path):
    """bench.serve_numbers.start, which the benchmark harnesses start servers with, waits the
    same way (bench/server_start.py): a taken port is given up at once for a new one."""
    import os
    import sys

    from bench import serve_numbers

    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    taken, free = ports.free_port(), ports.free_port()
    picks = iter([taken, free])
    log = str(tmp_path / "server.log")
    with pytest.MonkeyPatch.context() as mp, _listen(taken):
        mp.setattr(server_start, "free_port", lambda: next(picks))
        tic = time.time()
        proc, url, seconds = serve_numbers.start(
            env, log, timeout=120, command=[sys.executable, "-m", "fake_server"]
        )
    try:
        assert url == f"http://127.0.0.1:{free}"
        assert proc.poll() is None and seconds < 30 and time.time() - tic < 30
    finally:
        serve_numbers.stop(proc)
