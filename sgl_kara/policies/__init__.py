"""Compression policies (no SGLang import): the contract and registry in ``base``, the default
schedule (when, how much) in ``schedule``, one method per file. Importing this package registers
every policy below (one line each)."""

from . import h2o, kara, numerals, random, rkv, snapkv, streaming  # noqa: F401  (registry: one line per policy)
from .base import Policy, names, policy_class
from .kara import kept_count, select, select_ref, window_scores
from .snapkv import snapkv_scores, snapkv_select
from .streaming import streaming_select

__all__ = [
    "Policy",
    "names",
    "policy_class",
    "kept_count",
    "select",
    "select_ref",
    "window_scores",
    "snapkv_scores",
    "snapkv_select",
    "streaming_select",
]
