"""Waiting for a server started on a port (bench/ports.py): ready when /health answers 200, failed
at once when the process exits or the HTTP server could not bind its port.

SGLang's server does not exit when uvicorn cannot bind: it runs its warm-up against whatever holds
the port. A wait that only polled /health would then wait out its whole timeout (or, worse, take a
listener that answers for the server). The log shows uvicorn's line, so the wait reads it.

    wait_ready(proc, url, log_path, timeout)   seconds it took; PortTaken / RuntimeError / TimeoutError
    start_on_a_port(launch, stop, timeout)     launched and waited for on a free port, moved on a taken one
"""

from __future__ import annotations

import time

from bench.ports import free_port

# uvicorn's line when the HTTP server cannot bind its port.
PORT_TAKEN = "error while attempting to bind on address"


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port: another process holds it."""


def _log_says_port_taken(log_path: str) -> bool:
    try:
        with open(log_path, errors="replace") as f:
            return PORT_TAKEN in f.read()
    except OSError:
        return False


def wait_ready(proc, url: str, log_path: str, timeout: float, interval=0.25) -> float:
    """Poll ``url``/health until it answers 200 (returns the seconds waited). Raises RuntimeError
    when ``proc`` exits, PortTaken when its log (``log_path``) shows the bind failure, and
    TimeoutError after ``timeout`` seconds."""
    import requests

    tic = time.time()
    while time.time() - tic < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        if _log_says_port_taken(log_path):
            port = url.rsplit(":", 1)[-1]
            raise PortTaken(f"port {port} was taken; see {log_path}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return time.time() - tic
        except requests.RequestException:
            pass
        time.sleep(interval)
    raise TimeoutError(f"server not ready in {timeout}s; see {log_path}")


def start_on_a_port(
    launch, stop, timeout: float, port: int | None = None, tries: int = 3
):
    """``launch(port) -> (proc, log_path)`` on ``port``, or on a free one (bench/ports.py), and
    wait until it serves, within ``timeout`` seconds in all: (port, proc, seconds to ready). A port
    picked here that another process took before the server bound it is given up: ``stop(proc)``,
    and launched again on a new one (``tries`` in all). A given ``port`` is tried once."""
    tic = time.time()
    for attempt in range(1 if port else tries):
        picked = port or free_port()
        proc, log_path = launch(picked)
        try:
            left = timeout - (time.time() - tic)
            wait_ready(proc, f"http://127.0.0.1:{picked}", log_path, left)
            return picked, proc, time.time() - tic
        except PortTaken:
            stop(proc)
            if port or attempt == tries - 1:
                raise
