"""Per-request Kara stats in every response's ``meta_info["kara"]``.

SGLang's supported extension point: a SchedulerOutputStreamer subclass adds ``customized_info``.
Where SGLang delivers a key once, as one value, with the final output (patches/upstream 0002:
``is_final_value_customized_info_key``) the streamer flags ``kara`` so and hands it the dict;
else it flags it request-level and hands a one-element list that the tokenizer side (the
plugin's hook on ``update_request_meta_info``) unwraps. Either way clients read
``meta_info["kara"]["compressions"]`` directly.
"""

from __future__ import annotations

from sgl_kara import _sglang as adapter
from sgl_kara.scheduler import runtime

KEY = "kara"


def make_output_streamer(base, final_value: bool = False):
    """Built while SGLang's Scheduler.__init__ runs, so the runtime is looked up per call.
    ``final_value``: SGLang takes ``kara`` as a final value (the series' 0002)."""
    if final_value:
        return _final_value_streamer(base)

    class KaraOutputStreamer(base):
        has_additional_customized_info = True

        def build_additional_customized_info(self, reqs):
            out = super().build_additional_customized_info(reqs)
            out[KEY] = [[m] if m else [] for m in _metas(reqs)]  # the meta hook unwraps
            return out

        def is_request_level_customized_info_key(self, key: str) -> bool:
            return key == KEY or super().is_request_level_customized_info_key(key)

    KaraOutputStreamer.__name__ = f"Kara{base.__name__}"
    return KaraOutputStreamer


def _metas(reqs) -> list:
    """Each finished request's ``meta_info["kara"]`` (None: not finished, or not Kara's)."""
    kara = runtime.active()
    return [
        kara.meta(r) if kara is not None and adapter.finished(r) else None for r in reqs
    ]


def _final_value_streamer(base):
    """With the upstream series (0002): ``kara`` flagged a final value, sent once as the dict."""

    class KaraFinalValueStreamer(base):
        has_additional_customized_info = True

        def build_additional_customized_info(self, reqs):
            out = super().build_additional_customized_info(reqs)
            out[KEY] = _metas(reqs)
            return out

        def is_final_value_customized_info_key(self, key: str) -> bool:
            return key == KEY or super().is_final_value_customized_info_key(key)

    KaraFinalValueStreamer.__name__ = f"Kara{base.__name__}"
    return KaraFinalValueStreamer


def unwrap_meta_hook(
    original, self, meta_info, state, customized_info, index, finish_reason
):
    """TokenizerManager.update_request_meta_info: meta_info["kara"] is a dict, not a list."""
    result = original(
        self,
        meta_info=meta_info,
        state=state,
        customized_info=customized_info,
        index=index,
        finish_reason=finish_reason,
    )
    value = meta_info.get(KEY)
    if isinstance(value, list):
        if value:
            meta_info[KEY] = value[-1]
        else:
            del meta_info[KEY]
    return result
