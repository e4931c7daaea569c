"""Kara with global re-selection: each event re-scores every generated entry kept so far together
with the new window, and keeps the best of them all (a long-answer variant, not shipped).

Idea
    Kara compresses each window once, by the attention of that window's own queries, and never
    looks at it again: its limitation section calls this "not global". Here an event's region is
    every generated row of the request, [P, f + W - U): the entries earlier events kept and the
    new window's compressible part. The window's W queries score all of them (Kara's Eq. 4, one
    softmax per query over the whole region), and the event keeps the entries kept so far, f - P,
    plus the window's K: the KV the request holds equals Kara's at every step, but budget moves
    from old windows the latest queries ignore to recent entries they attend. Token2Chunk runs on
    the whole region (a chunk joins two kept rows that are neighbours in the row).

Paper
    Kara (seed 000, Eq. 4-8); re-scoring of old keys at every round as in TriAttention.

Parameters: Kara's (flags --kara-global-<name>). Per-request retention as Kara's.

Run it with the long-answer harness: ``--policy-file bench/policies/kara_global.py
--configs kara_global``.
"""

from __future__ import annotations

from dataclasses import replace

from sgl_kara.policies.base import Region, RowView, register
from sgl_kara.policies.kara import KaraPolicy


def global_region(window: Region, protected: int) -> Region:
    """Kara's window region widened down to the protected rows: the rows kept before it join
    the region and stay in the kept count, so the event drops as many rows as Kara's."""
    held = window.start - protected
    return replace(
        window, start=protected, length=held + window.length, keep=held + window.keep
    )


@register
class KaraGlobalPolicy(KaraPolicy):
    """Kara's schedule and windows; the region is every generated row, re-selected."""

    name = "kara_global"
    prefix = "global_"
    additive = True  # Eq. 4 over a wider region: still a sum over the window's queries

    def window_region(self, row: RowView) -> Region:
        return global_region(super().window_region(row), row.protected)
