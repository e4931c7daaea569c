"""Index tensors from host values onto the device without making the host wait.

A Kara step runs on SGLang's schedule stream after the forward in flight (the runtime's fence).
A ``torch.tensor(values, device="cuda")`` there copies from ordinary (pageable) host memory,
which CUDA does synchronously: the host would wait for that forward to finish, and SGLang's
overlap scheduler would lose exactly the steps Kara works on. ``DeviceStaging.to_device``
writes the values into a pinned host buffer and copies it with ``non_blocking=True``: the copy
is queued on the stream like any kernel and the host goes on.

    pinned ring    SLOTS buffers, each grown on demand and reused; slot i is written again only
                   after the copy that last read it completed (its CUDA event; by then long
                   done, so the host does not wait in practice)

On a CPU the host tensor is the device tensor. Every host-to-device copy of a Kara step goes
through here (``KARA_CHECK_SYNC``, scheduler/sync_check.py, fails any other).
"""

from __future__ import annotations

import torch

SLOTS = 8


class DeviceStaging:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * SLOTS
        self._events: list = [None] * SLOTS
        self._next = 0
        self.on_copy = None  # (host, device) -> None: the sync check's record of a copy

    def to_device(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``values`` (a list of ints or a host tensor) as a tensor on the device."""
        host = torch.as_tensor(values, dtype=dtype)
        if not self.cuda:
            if self.on_copy is not None:
                self.on_copy(host)
            return host
        n = host.numel()
        slot = self._next
        self._next = (slot + 1) % SLOTS
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer (already complete)
        nbytes = n * host.element_size()
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buf
        pinned = buf[:nbytes].view(dtype).view(host.shape)
        pinned.copy_(host)
        out = pinned.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event
        return out
