"""``KARA_CHECK_SYNC=1``: every Kara step is run as if its device were a GPU whose copies are
recorded, and anything that would make the host wait for the device is counted
(``KaraStats.sync_violations``, the first few described in ``sync_examples``).

On a GPU the host waits for the stream (and so for the forward in flight) when it reads a device
value (``.item()``, ``.tolist()``, ``int()``, ``bool()``, ``.cpu()``, ``.numpy()``) or copies from
ordinary host memory to the device (``torch.tensor(values, device=...)``, ``host.to(device)``
without a pinned source, or a host tensor used as an index or operand of a device op, which
torch copies implicitly). Here every tensor is tracked as host or device: the device tensors are
those the step was given (the pools, the rows, the batch's device lengths, Kara's device state)
and everything computed from them; factory calls with ``device=`` make device tensors; the one
sanctioned host-to-device path is ``DeviceStaging.to_device`` (pinned, non-blocking). Calls made
from SGLang's own code inside the step (the allocator, the recompute forward) are SGLang's, and
the CPU serving kit's never run on a GPU: neither is judged; their results count as device
tensors. Works on any device, so the CPU tests run it.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode

EXAMPLES = 8
Tensor = torch.Tensor
READS = {
    Tensor.item: "item()",
    Tensor.tolist: "tolist()",
    Tensor.__int__: "int()",
    Tensor.__float__: "float()",
    Tensor.__bool__: "bool()",
    Tensor.__index__: "index()",
    Tensor.numpy: "numpy()",
    Tensor.cpu: "cpu()",
}
FROM_HOST_DATA = (torch.tensor, torch.as_tensor)
FACTORIES = (
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
)
# Metadata and host-side bookkeeping that never touch device memory.
METADATA = {
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.element_size,
    Tensor.__len__,
    Tensor.data_ptr,
    Tensor.stride,
    Tensor.is_contiguous,
    Tensor.__hash__,
}


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _names_device(args, kwargs) -> bool:
    """Does a ``Tensor.to`` call name a device (or another tensor's)?"""
    return kwargs.get("device") is not None or any(
        isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:]
    )


def _caller_module() -> str:
    """The module of the nearest frame outside torch and this file (who called the op)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name == __name__):
            return name
        frame = frame.f_back
    return ""


class _TensorSet:
    """Tensors by identity (a tensor's ``==`` is elementwise), held weakly."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, k=key: self._refs.pop(k, None))

    def __contains__(self, t) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


class SyncCheck(TorchFunctionMode):
    def __init__(self, device_tensors=()):
        super().__init__()
        self.device = _TensorSet()
        self.violations = 0
        self.examples: list[str] = []
        for t in device_tensors:
            self.mark(t)

    def mark(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.device.add(t)

    def staged(self, host: torch.Tensor) -> None:
        """DeviceStaging's copy: the result is a device tensor, copied without a wait."""
        self.mark(host)

    def _violate(self, what: str) -> None:
        self.violations += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{what} (from {_caller_module()})")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:
            return func(*args, **kwargs)
        caller = _caller_module()
        # The CPU serving kit never runs on a GPU (its hooks are registered where there is none).
        judged = caller.startswith("sgl_kara") and not caller.startswith("sgl_kara.cpu")
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        on_device = [t for t in inputs if t in self.device]
        if judged:
            self._judge(func, args, kwargs, inputs, on_device)
        out = func(*args, **kwargs)
        makes_device = bool(on_device) or caller.startswith("sglang")
        if func in FACTORIES and kwargs.get("device") is not None:
            makes_device = True
        if func is Tensor.to and _names_device(args, kwargs):
            makes_device = True
        if func in READS:
            makes_device = False
        if makes_device:
            self.mark(*_tensors(out, []))
        return out

    def _judge(self, func, args, kwargs, inputs, on_device) -> None:
        name = getattr(func, "__name__", repr(func))
        if func in READS:
            if args and args[0] in self.device:
                self._violate(f"device value read on the host: {READS[func]}")
            return
        if func in FROM_HOST_DATA and kwargs.get("device") is not None:
            self._violate(f"torch.{name}(host values, device=...): a pageable copy")
            return
        if func is Tensor.to:
            if _names_device(args, kwargs) and args[0] not in self.device:
                self._violate("host tensor .to(device): a pageable copy")
            return
        if on_device:
            host = [t for t in inputs if t not in self.device and t.dim() > 0]
            if host:
                self._violate(
                    f"{name} mixes a host tensor {tuple(host[0].shape)} into a device op "
                    "(an implicit pageable copy)"
                )
