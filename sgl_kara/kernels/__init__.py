"""Kernels for scoring (window_score) and compaction (compact); selection is vectorised torch in
sgl_kara.policies. Imports nothing from SGLang or the rest of sgl_kara; every kernel has a
same-signature torch `*_ref`."""

from .compact import compact_kv, compact_kv_ref, copy_slots, copy_slots_ref
from .window_score import window_scores, window_scores_paged, window_scores_paged_ref

__all__ = [
    "compact_kv",
    "compact_kv_ref",
    "copy_slots",
    "copy_slots_ref",
    "window_scores",
    "window_scores_paged",
    "window_scores_paged_ref",
]
