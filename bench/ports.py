"""A TCP port for a server that binds it later (benchmarks and tests start servers on one).

A port from ``bind(("", 0))`` lies in the kernel's ephemeral range, which the kernel hands out
again to any socket bound to port 0 in the meantime: the server's own processes open such sockets
while they start (gloo's listeners between tensor-parallel ranks, outgoing connections). One of
them can take the port before the HTTP server binds it; the HTTP server then fails to bind while a
listener that never answers HTTP holds the port. A port below the ephemeral range is never handed
out that way. SGLang keeps its own later-bound ports (the torch.distributed port) in 22000-29999,
and serves on 30000 by default: these ports lie above both.
"""

from __future__ import annotations

import random
import socket

LOW = 30100  # above SGLang's 22000-29999 and its default serving port 30000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()


def ephemeral_low(path: str = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int) -> bool:
    """Can a listener bind ``port`` on every address now (no SO_REUSEADDR, as a server binds)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port(low: int = LOW, high: int | None = None) -> int:
    """A port in [low, high] (high: below the ephemeral range) that binds now and that this
    process has not handed out before; raises RuntimeError when none of the range does."""
    high = ephemeral_low() - 1 if high is None else high
    if high < low:
        raise RuntimeError(
            f"no port below the ephemeral range: it starts at {high + 1} ({EPHEMERAL_RANGE}), "
            f"at or below {low}"
        )
    candidates = [p for p in range(low, high + 1) if p not in _handed_out]
    random.shuffle(candidates)
    for port in candidates:
        if bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {low}-{high}")
