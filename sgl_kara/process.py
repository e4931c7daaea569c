"""What sgl_kara holds per process, in one owner with a lifecycle: which parts of the plugin's hooks
are registered, the compression policy of the server this process fronts (per-request checks), the
Kara runtime of a scheduler process, what the core tells the CPU serving kit (whether a Kara
recompute forward is running), and the trace file (opened at the first traced step, closed at
shutdown: the scheduler's exit or the interpreter's). Imports nothing of sgl_kara or SGLang."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import IO, Any


def _never() -> bool:
    return False


class ProcessState:
    def __init__(self):
        # The plugin's parts whose hooks are in SGLang's registry (plugin.PARTS), and
        # "packed_linear" when the cpu_kernels part included the linear hooks.
        self.parts: set[str] = set()
        # The core's hook targets registered in this process (the serving and trace parts),
        # each once: /server_info lists them (none where SGLang has every extension point)
        self.hooks: list[str] = []
        # set in the process that validates requests (launcher / Engine)
        self.serving_policy: str | None = None
        self.runtime: Any = None  # the KaraRuntime of this scheduler process (None: the hooks stay inert)
        # Is a Kara recompute forward running in this process now? The CPU kit's extend hook asks
        # (its window-only path; the kit imports nothing of the scheduler); the plugin's serving
        # part sets the core's answer when it registers (plugin.recompute_in_flight).
        self.recompute_in_flight: Callable[[], bool] = _never
        self._trace: IO[str] | None = None
        self._exit_hook = False

    def trace_file(self, path: str) -> IO[str]:
        """The trace file, opened for appending (line-buffered: a killed process loses no line) at
        first use, and again after a shutdown."""
        if self._trace is None:
            self._trace = open(path, "a", buffering=1)
            if not self._exit_hook:
                atexit.register(self.shutdown)
                self._exit_hook = True
        return self._trace

    @property
    def trace_open(self) -> bool:
        return self._trace is not None

    def shutdown(self) -> None:
        """This process stops serving: the trace file is closed and the runtime deactivated (the
        hooks inert again). Registration and the serving policy stay. Safe to call twice."""
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.close()
        self.runtime = None


STATE = ProcessState()
