"""Kernels for the three Kara steps: score (window_score), select, compact.
Imports nothing from SGLang; every kernel has a same-signature torch `*_ref`."""

from .compact import compact_kv, compact_kv_ref, copy_slots, copy_slots_ref
from .select import select_batched
from .window_score import window_scores_paged, window_scores_paged_ref

__all__ = [
    "compact_kv",
    "compact_kv_ref",
    "copy_slots",
    "copy_slots_ref",
    "select_batched",
    "window_scores_paged",
    "window_scores_paged_ref",
]
