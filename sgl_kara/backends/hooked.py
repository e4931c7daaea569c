"""Kara on SGLang 0.5.23 as released: the plugin's hooks stand in for the series' extension
points (plugin.serving_hooks), and what SGLang's own calls would do is done here. Imported only
where SGLang has none of the series (backends.choose)."""

from __future__ import annotations

from sgl_kara import _sglang as adapter
from sgl_kara.backends import Backend


class Hooks(Backend):
    name = "hooks"
    hooked = True
    runs_recompute = (
        False  # sgl_kara builds the recompute batch; the attention hook ends it
    )
    asks_admission = False  # the charge presented as max_new_tokens (admission.py)

    def touch_points(self) -> dict[str, str]:
        return {point: "hook" for point in adapter.EXTENSION_POINTS}

    def configure(self, server_args) -> None:
        pass  # the retraction order hook reorders SGLang's own policy

    def position_offsets(self, parts):
        return (
            None  # the init_new hook adds each row's offset to the forward's positions
        )

    def observe_attention(self, forward):
        return None  # the attention hook calls the forward context itself

    def release_tail(self, batch, jobs, prepared, step) -> int:
        """Rows rewritten and the old slots freed by id, then the requests' and the batch's
        lengths shrunk and their rows' position offsets raised by what was dropped."""
        dropped = prepared.commit(step.parts.req_to_token, step.parts.free_page_ids)
        if dropped:
            for job in jobs:
                adapter.drop_rows(job.req, dropped)
            index = [job.index for job in jobs]
            adapter.shrink_lengths(batch, index, dropped, step.staging.to_device(index))
            step.forward.add_offset(step.rows, dropped)
        return dropped

    def release_loop_tasks(self, engine) -> None:
        adapter.release_loop_tasks(engine)
