"""Index tensors from host values onto the device without making the host wait.

A Kara step runs on SGLang's schedule stream after the forward in flight (the runtime's fence).
A ``torch.tensor(values, device="cuda")`` there copies from ordinary (pageable) host memory,
which CUDA does synchronously: the host would wait for that forward to finish, and SGLang's
overlap scheduler would lose exactly the steps Kara works on. ``DeviceStaging.to_device``
writes the values into a pinned host buffer and copies it with ``non_blocking=True``: the copy
is queued on the stream like any kernel and the host goes on.

    pinned buffers   a pool, each buffer with the CUDA event of the copy that last read it; a
                     copy takes a buffer whose copy has completed (``Event.query()``: asked, never
                     waited for), else a new one -- so a step with more copies than the pool
                     holds, or copies still queued behind the forward in flight, never waits
                     for its own earlier copies; the pool holds at most what the busiest step
                     needed, and a buffer too small for the values is replaced, not waited on

On a CPU the host tensor is the device tensor. Every host-to-device copy of a Kara step goes
through here (``KARA_CHECK_SYNC``, sgl_kara/diagnostics/sync_check.py, fails any other),
and each copy's result is shown to the step observers (``staged``; none in production).
"""

from __future__ import annotations

import torch

from sgl_kara.scheduler.observers import Observers

MIN_BYTES = 4096


class DeviceStaging:
    def __init__(self, device: torch.device, observers: Observers | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # [pinned uint8 buffer, the event of the copy that last read it (None: never read)]
        self._pool: list[list] = []
        # the runtime's step observers (here only ``staged`` is called)
        self.observers = observers if observers is not None else Observers()

    def to_device(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``values`` (a list of ints or a host tensor) as a tensor on the device."""
        host = torch.as_tensor(values, dtype=dtype)
        if not self.cuda:
            self.observers.staged(host)
            return host
        nbytes = host.numel() * host.element_size()
        entry = self._free_buffer(nbytes)
        pinned = entry[0][:nbytes].view(dtype).view(host.shape)
        pinned.copy_(host)
        out = pinned.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        entry[1] = event
        self.observers.staged(out)
        return out

    def _free_buffer(self, nbytes: int) -> list:
        """A pool entry no queued copy reads, holding at least ``nbytes`` (the host never
        waits: a busy pool grows)."""
        idle = [e for e in self._pool if e[1] is None or e[1].query()]
        fits = [e for e in idle if e[0].numel() >= nbytes]
        if fits:
            return min(fits, key=lambda e: e[0].numel())
        buf = self._pinned(max(nbytes, MIN_BYTES))
        if idle:  # replace the largest idle buffer that is too small
            entry = max(idle, key=lambda e: e[0].numel())
            entry[0], entry[1] = buf, None
            return entry
        entry = [buf, None]
        self._pool.append(entry)
        return entry

    @staticmethod
    def _pinned(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @property
    def buffers(self) -> int:
        """Pinned buffers held (the most copies one step had in flight at once)."""
        return len(self._pool)
