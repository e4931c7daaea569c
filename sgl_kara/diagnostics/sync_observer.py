"""``KARA_CHECK_SYNC=1``'s step observer: each Kara step runs under a ``SyncCheck``
(sync_check.py). The check is given the device tensors the step starts from, is told of
each staged copy and of the fence, and counts the host waits. The counts are reported in
/server_info's Kara state: ``sync_violations`` (waits after the fence, which wait for
the forward in flight) and ``sync_pre_fence_waits`` (SGLang's waits before it, which
wait for the schedule stream only), with the first few of each in ``sync_examples`` and
``sync_pre_fence_examples``.
"""

from __future__ import annotations

import torch

from sgl_kara.diagnostics.sync_check import EXAMPLES, SyncCheck
from sgl_kara.scheduler.observers import StepObserver


class SyncObserver(StepObserver):
    def __init__(self):
        self.check: SyncCheck | None = None  # the check of the step being run
        self.violations = 0
        self.examples: list[str] = []
        self.pre_fence = 0
        self.pre_fence_examples: list[str] = []

    def before_step(self, runtime, batch) -> None:
        check = SyncCheck(_device_tensors(runtime, batch))
        check.__enter__()
        self.check = check

    def staged(self, tensor) -> None:
        if self.check is not None:
            self.check.staged(tensor)

    def fenced(self) -> None:
        if self.check is not None:
            self.check.fenced()

    def after_step(self) -> None:
        """The step's counts added to the totals (``EXAMPLES`` of each kind kept)."""
        check, self.check = self.check, None
        if check is None:
            return
        check.__exit__(None, None, None)
        self.violations += check.violations
        self.examples += check.examples[: max(0, EXAMPLES - len(self.examples))]
        self.pre_fence += check.pre_fence
        room = EXAMPLES - len(self.pre_fence_examples)
        self.pre_fence_examples += check.pre_fence_examples[: max(0, room)]

    def stats(self) -> dict:
        return {
            "sync_violations": self.violations,
            "sync_examples": list(self.examples),
            "sync_pre_fence_waits": self.pre_fence,
            "sync_pre_fence_examples": list(self.pre_fence_examples),
        }


def _device_tensors(runtime, batch) -> list:
    """What a GPU would hold of the step's inputs: the pools, rows and offsets, the
    batch's device lengths, the ring, Kara's per-request device state."""
    from sgl_kara import _sglang as adapter

    parts = runtime.parts
    device = [parts.req_to_token, runtime.forward.offsets]
    device += [parts.keys(i) for i in parts.layer_ids]
    device += [parts.values(i) for i in parts.layer_ids]
    device += adapter.batch_device_tensors(batch)
    if runtime.ring is not None:
        device += [*runtime.ring.buffers.values(), runtime.ring.row_of]
    for req in adapter.running_requests(batch):
        state = runtime.table.get(req)
        if state is not None:
            device += _tensors_in(state.policy_state)
            scores = getattr(state.scoring, "scores", None)
            if scores is not None:
                device.append(scores)
    return device


def _tensors_in(d) -> list:
    """Tensors in nested dicts (a policy's per-request state)."""
    out = []
    for v in d.values():
        if isinstance(v, dict):
            out += _tensors_in(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out
