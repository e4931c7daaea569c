"""Kara on SGLang's extension points (the upstream series applied, patches/upstream): no hook,
SGLang's own calls at every touch point."""

from __future__ import annotations

from sgl_kara import _sglang as adapter
from sgl_kara.backends import Backend, retraction_policy_name


class ExtensionPoints(Backend):
    name = "extension points"
    hooked = False
    runs_recompute = True  # 0008's cached extend, seen by the observers (0006)
    asks_admission = True  # PrefillAdder.reserved_new_tokens (0010)

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

    def release_tail(self, batch, jobs, prepared, step) -> int:
        """Every request's rows, old slots, lengths and position offset through one SGLang
        call (0008)."""
        ranges = [
            (job.index, start, slots, stop)
            for job, (start, slots, stop) in zip(jobs, prepared.ranges)
        ]
        drops = adapter.release_kv_tails(batch, ranges)
        prepared.released()
        assert all(d == prepared.dropped for d in drops), (drops, prepared.dropped)
        return prepared.dropped

    def release_loop_tasks(self, engine) -> None:
        pass  # SGLang's shutdown releases them (0009)
