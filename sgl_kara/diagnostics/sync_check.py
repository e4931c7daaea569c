"""``KARA_CHECK_SYNC=1``: every Kara step is run as if its device were a GPU whose copies are
recorded, and anything that would make the host wait for the device is counted
(``sync_violations`` in /server_info, the first few described in ``sync_examples``: the
step observer that runs it is sync_observer.py).

On a GPU the host waits for the stream (and so for the forward in flight) when it

- reads a device value: ``.item()``, ``.tolist()``, ``int()``, ``float()``, ``bool()``, an index,
  ``.cpu()``, ``.numpy()``;
- copies from ordinary host memory to the device: ``torch.tensor(values, device=...)``,
  ``host.to(device)`` without a pinned source, or a host tensor used as an index or operand of a
  device op (torch copies it implicitly);
- runs an operation whose output size depends on device values: boolean-mask indexing (read or
  write), ``nonzero`` / ``argwhere``, ``masked_select``, one-argument ``where``, ``unique`` /
  ``unique_consecutive`` (SGLang's paged ``free`` runs it), ``repeat_interleave`` with device
  repeats and no ``output_size``;
- synchronizes explicitly: ``torch.cuda.synchronize``, ``Event.synchronize``,
  ``Stream.synchronize``.

Every tensor is tracked as host or device: the device tensors are those the step was given (the
pools, the rows, the batch's device lengths, Kara's device state) and everything computed from
them; factory calls with ``device=`` make device tensors; the one sanctioned host-to-device path
is ``DeviceStaging.to_device`` (pinned, non-blocking). Code of sgl_kara is judged everywhere in
the step; SGLang's own code called inside it (the allocator, the radix tree's eviction, the
recompute forward's batch building and model) is judged too, but a wait there before the step's
fence (``fenced()``: from then on its work is ordered after the forward in flight) waits for the
schedule stream only, not that forward: it is counted apart (``pre_fence``), and only one after
the fence is a violation. SGLang's device state beyond what the step was given (weights, the
allocator's free lists) is not tracked, so in SGLang's code a tensor counts as host only when the
step made it from host data (``torch.tensor`` / a factory without a device, and what is computed
from those alone): a blocking ``.to(device)`` of one is a wait (``non_blocking=True`` queues the
copy: CUDA stages pageable memory without waiting for the device), and the host-operand rule is
not applied; its reads, host-data copies, data-dependent sizes and explicit syncs are judged. Not judged: code that never runs on a GPU -- the CPU serving kit and
SGLang's CPU-only attention backend (``CPU_ONLY``), whose GPU counterparts' waits docs/GPU.md
lists. Works on any device, so the CPU tests run it.
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
# Factories whose result is on the host unless ``device=`` says otherwise (not the *_like ones).
NEW_TENSORS = (torch.arange, torch.zeros, torch.ones, torch.empty, torch.full)
# Operations whose output's size depends on device values: the host reads it first.
DATA_DEPENDENT = {
    torch.nonzero: "nonzero",
    Tensor.nonzero: "nonzero",
    torch.argwhere: "argwhere",
    Tensor.argwhere: "argwhere",
    torch.masked_select: "masked_select",
    Tensor.masked_select: "masked_select",
    torch.unique: "unique",
    Tensor.unique: "unique",
    torch.unique_consecutive: "unique_consecutive",
    Tensor.unique_consecutive: "unique_consecutive",
}
INDEXING = (Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.index_put)
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
# Code that never runs on a GPU: the CPU serving kit, and SGLang's CPU-only attention backend
# (on a GPU FlashInfer, fa3 or Triton runs instead: docs/GPU.md lists their waits).
CPU_ONLY = ("sgl_kara.cpu", "sglang.srt.layers.attention.torch_native_backend")
EXPLICIT_SYNCS = (
    (torch.cuda, "synchronize", "torch.cuda.synchronize()"),
    (torch.cuda.Event, "synchronize", "Event.synchronize()"),
    (torch.cuda.Stream, "synchronize", "Stream.synchronize()"),
)


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


def _caller_module(depth: int = 2) -> str:
    """The module of the nearest frame outside torch and this file (who called the op)."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name == __name__):
            return name
        frame = frame.f_back
    return ""


def _bool_index(index) -> bool:
    """Does an index (a tensor, or a tuple / list of them) hold a boolean tensor?"""
    return any(t.dtype == torch.bool for t in _tensors(index, []))


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
    """Counts host waits while active (``with SyncCheck(device_tensors):``): ``violations``
    (and ``examples``), and SGLang's waits before the fence apart (``pre_fence``,
    ``pre_fence_examples``)."""

    def __init__(self, device_tensors=()):
        super().__init__()
        self.device = _TensorSet()
        self.host = _TensorSet()  # made on the host from host data inside the step
        self.violations = 0
        self.examples: list[str] = []
        self.pre_fence = 0
        self.pre_fence_examples: list[str] = []
        self.after_fence = False
        self._saved = []
        for t in device_tensors:
            self.mark(t)

    def mark(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.device.add(t)

    def staged(self, host: torch.Tensor) -> None:
        """DeviceStaging's copy: the result is a device tensor, copied without a wait."""
        self.mark(host)

    def fenced(self) -> None:
        """The step's work is ordered after the forward in flight from here on."""
        self.after_fence = True

    # ------------------------------------------------------------------ explicit syncs
    def __enter__(self):
        for owner, name, what in EXPLICIT_SYNCS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._recording(original, what))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()

    def _recording(self, original, what: str):
        check = self

        def call(*args, **kwargs):
            caller = _caller_module(1)
            if check._judged(caller):
                check._violate(what, caller)
            return original(*args, **kwargs)

        return call

    # ------------------------------------------------------------------ torch functions
    @staticmethod
    def _judged(caller: str) -> bool:
        if caller.startswith(CPU_ONLY):
            return False
        return caller.startswith(("sgl_kara", "sglang"))

    def _violate(self, what: str, caller: str) -> None:
        if caller.startswith("sglang") and not self.after_fence:
            self.pre_fence += 1
            if len(self.pre_fence_examples) < EXAMPLES:
                self.pre_fence_examples.append(f"{what} (from {caller})")
            return
        self.violations += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{what} (from {caller})")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:
            return func(*args, **kwargs)
        caller = _caller_module()
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        on_device = [t for t in inputs if t in self.device]
        if self._judged(caller):
            self._judge(func, args, kwargs, inputs, on_device, caller)
        out = func(*args, **kwargs)
        if self._makes_host(func, kwargs, inputs):
            for t in _tensors(out, []):
                self.host.add(t)
            return out
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

    def _makes_host(self, func, kwargs, inputs) -> bool:
        """Is the result a host tensor made in the step from host data alone?"""
        if func in FROM_HOST_DATA or func in NEW_TENSORS:
            return kwargs.get("device") is None
        # a *_like factory takes its input's device: host only from a host tensor (below)
        if func is Tensor.to or func in READS:
            return False
        return bool(inputs) and all(
            t in self.host and t not in self.device for t in inputs
        )

    def _judge(self, func, args, kwargs, inputs, on_device, caller) -> None:
        name = getattr(func, "__name__", repr(func))
        if func in READS:
            if args and args[0] in self.device:
                self._violate(f"device value read on the host: {READS[func]}", caller)
            return
        if func in FROM_HOST_DATA and kwargs.get("device") is not None:
            self._violate(
                f"torch.{name}(host values, device=...): a pageable copy", caller
            )
            return
        if func is Tensor.to:
            if not _names_device(args, kwargs) or args[0] in self.device:
                return
            if not caller.startswith("sglang"):
                self._violate("host tensor .to(device): a pageable copy", caller)
            elif args[0] in self.host and not kwargs.get("non_blocking", False):
                self._violate("host tensor .to(device) blocking: a waited copy", caller)
            return
        if not on_device:
            return
        if func in DATA_DEPENDENT:
            self._violate(f"{DATA_DEPENDENT[func]}: its size read on the host", caller)
            return
        if func in (torch.where, Tensor.where) and len(args) + len(kwargs) == 1:
            self._violate("one-argument where: its size read on the host", caller)
            return
        if (
            func in (torch.repeat_interleave, Tensor.repeat_interleave)
            and kwargs.get("output_size") is None
            and len(args) >= 2
            and isinstance(args[1], torch.Tensor)
            and args[1] in self.device
        ):
            self._violate("repeat_interleave without output_size", caller)
            return
        if func in INDEXING and len(args) >= 2 and _bool_index(args[1]):
            self._violate(f"boolean-mask {name}: its size read on the host", caller)
            return
        if caller.startswith("sglang"):
            return  # its own device state (weights, free lists) is not tracked: see above
        host = [t for t in inputs if t not in self.device and t.dim() > 0]
        if host:
            self._violate(
                f"{name} mixes a host tensor {tuple(host[0].shape)} into a device op "
                "(an implicit pageable copy)",
                caller,
            )
