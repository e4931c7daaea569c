"""Per-request Kara state, stored on SGLang's ``Req`` as ``req.kara``.

Row layout of one request in ``req_to_token`` (see ARCHITECTURE.md):

    row pos: 0 ............ P ........... f .................. L
            [ tree-owned   |  compressed   | uncompressed tail        ]
              prefix slots    windows         (next window + new tokens)

    logical position of row pos p >= P  =  p + pos_offset  (for p >= f; kept entries below f
    keep the RoPE they were written with, so only new tokens need the offset)

The scheduler's KaraRuntime is the one owner of this state; lengths stay physical in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KaraReqState:
    enabled: bool = True
    retention: float | None = None  # per-request override of KaraConfig.retention
    protected: int = -1  # P: rows [0, P) are never written or freed; -1 until the first event
    frontier: int = 0  # f: first uncompressed row (>= P once fixed)
    pos_offset: int = 0  # tokens dropped so far: logical = physical + pos_offset past f
    compressions: int = 0
    capture_from: int | None = None  # first logical position whose query is in the capture ring (None: no ring row)
    kv_peak: int = 0  # largest physical KV length seen at a decode step
    kv_sum: int = 0  # sum of physical KV lengths over decode steps (mean = kv_sum / kv_steps)
    kv_steps: int = 0
    budget: int | None = None  # per-request snapkv/streaming budget (custom_params kara.budget)
    # Diagnostics (SGL_KARA_CHECK_INTEGRITY / SGL_KARA_CROSSCHECK_QUERIES only).
    prefix_snapshot: object = field(default=None, repr=False, compare=False)
    integrity_checks: int = 0
    crosscheck_err: float | None = None
    logical_rows: object = field(default=None, repr=False, compare=False)  # SGL_KARA_RECORD_EVICTIONS only

    def meta(self, physical_len: int) -> dict:
        return {
            "compressions": self.compressions,
            "kv_physical_len": physical_len,
            "kv_logical_len": physical_len + self.pos_offset,
            "kv_peak_len": max(self.kv_peak, physical_len),
            "kv_mean_len": self.kv_sum / self.kv_steps if self.kv_steps else float(physical_len),
            "enabled": self.enabled,
        }


def get_state(req) -> KaraReqState | None:
    return getattr(req, "kara", None)


def ensure_state(req, default_enabled: bool = True) -> KaraReqState:
    state = getattr(req, "kara", None)
    if state is None:
        state = KaraReqState(enabled=default_enabled)
        req.kara = state
    return state
