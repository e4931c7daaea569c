"""Kara on SGLang's extension points (the upstream series applied, patches/upstream): no hook,
SGLang's own calls at every touch point."""

from __future__ import annotations

from sgl_kara import _sglang as adapter
from sgl_kara.backends import Backend, retraction_policy_name


class ExtensionPoints(Backend):
    name = "extension points"
    hooked = False
    runs_recompute = True  # 0010, its queries seen by the attention observers (0006)
    asks_admission = True  # PrefillAdder.reserved_new_tokens (0012)

    def touch_points(self) -> dict[str, str]:
        return {
            point: f"extension point ({patch})"
            for point, (patch, _, _) in adapter.EXTENSION_POINTS.items()
        }

    def configure(self, server_args) -> None:
        """Kara's retraction order over the policy the user chose (0005's registry)."""
        base = adapter.server_arg(server_args, "retraction_policy") or "length"
        adapter.set_server_arg(
            server_args, "retraction_policy", retraction_policy_name(base)
        )

    def position_offsets(self, parts):
        return parts.position_offsets()  # 0008

    def observe_attention(self, forward):
        """``forward``'s attention observer registered with SGLang (0006); its removal."""
        return adapter.register_attention_observer(forward.observer())

    def release_tail(self, batch, jobs, prepared, parts, staging) -> int:
        """Each request's rows, old slots and lengths through one SGLang call (0009)."""
        for job, (start, slots, stop) in zip(jobs, prepared.ranges):
            adapter.release_kv_tail(batch, job.index, start, slots, stop)
        prepared.released()
        return prepared.dropped

    def release_loop_tasks(self, engine) -> None:
        pass  # SGLang's shutdown releases them (0011)
