"""Pure selection policies (no SGLang import): Kara, SnapKV, StreamingLLM."""

from .kara import kept_count, select, select_ref, window_scores
from .snapkv import snapkv_scores, snapkv_select
from .streaming import streaming_select

__all__ = [
    "kept_count",
    "select",
    "select_ref",
    "window_scores",
    "snapkv_scores",
    "snapkv_select",
    "streaming_select",
]
