"""KaraConfig: the one frozen, validated configuration of sgl_kara.

Every knob has one name, used three ways:
  CLI flag ``--kara-<name-with-dashes>``, Engine keyword ``kara_<name>``, field ``<name>``.

Defaults follow the Kara paper's settings (seed 000, App. B.1 / B.3):
  window W=512 (swept 256/384/512), buffer U=32, retention r=0.25 of the W-U compressible
  tokens, chunk budget α=16, max chunk γ=8, period δ=128 decode steps, max_seqs=30 per event.
SnapKV-threshold baseline (App. B.1): compress when generated KV exceeds C_max=1280 entries back
to N=1024, with a w=32 query observation window and pooling kernel 7.
StreamingLLM baseline: same trigger and budget as SnapKV, keeps ``streaming_sinks`` + recent.

This module imports nothing from SGLang.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from sgl_kara.policies.kara import kept_count  # noqa: F401  (re-exported: K of a window)

POLICIES = ("kara", "snapkv", "streaming", "none")
QUERY_SOURCES = ("auto", "recompute", "capture")
SCORINGS = ("bidirectional", "buffer")


class KaraConfigError(ValueError):
    """A Kara option is invalid. ``flag`` names the CLI flag, the message the accepted range."""

    def __init__(self, name: str, message: str):
        self.name = name
        self.flag = flag_name(name)
        super().__init__(f"{self.flag} (kara_{name}): {message}")


# Fields whose None (the default) is replaced by a value derived from the others.
DERIVED = ("chunk_budget",)
PAPER_CHUNK_BUDGET = 16


def default_chunk_budget(kept: int) -> int:
    """alpha when unset: the paper's 16 (App. B.3) where a window keeps K >= 32 entries, else
    floor(K/2), so TopK always keeps at least half of the K entries (valid for every W, U, r)."""
    return min(PAPER_CHUNK_BUDGET, kept // 2)


def _field_kind(f) -> type:
    if isinstance(f.type, type):
        return f.type
    return {"int": int, "float": float, "str": str, "int | None": int}[f.type]


def flag_name(name: str) -> str:
    return "--kara-" + name.replace("_", "-")


@dataclass(frozen=True)
class KaraConfig:
    policy: str = field(default="kara", metadata={"help": f"compression policy: one of {POLICIES}"})
    window: int = field(default=512, metadata={"help": "W: tokens per compression window"})
    buffer: int = field(default=32, metadata={"help": "U: last tokens of a window never compressed"})
    retention: float = field(
        default=0.25, metadata={"help": "r: fraction of the W-U compressible tokens kept, in (0, 1]"}
    )
    chunk_budget: int | None = field(
        default=None,
        metadata={"help": "alpha: entries Token2Chunk may add (0 disables Token2Chunk); "
                          "unset: min(16, floor(K/2)), K = ceil(retention*(window-buffer))"},
    )
    max_chunk: int = field(
        default=8, metadata={"help": "gamma: max chunk length including both endpoints, >= 3"}
    )
    scoring: str = field(
        default="bidirectional",
        metadata={"help": f"window scoring: {SCORINGS} ('buffer' = last U queries only, ablation)"},
    )
    period: int = field(default=128, metadata={"help": "delta: decode steps between compression events"})
    max_seqs: int = field(default=30, metadata={"help": "N: max requests compressed per event"})
    query_source: str = field(
        default="auto",
        metadata={"help": f"window queries: {QUERY_SOURCES} (auto: capture on CPU, recompute on CUDA "
                          "unless the ring is small; resolved at start-up)"},
    )
    snapkv_threshold: int = field(
        default=1280, metadata={"help": "C_max: generated KV entries that trigger snapkv/streaming"}
    )
    snapkv_budget: int = field(
        default=1024, metadata={"help": "N: generated KV entries kept by snapkv/streaming"}
    )
    snapkv_window: int = field(
        default=32, metadata={"help": "w: observation queries (snapkv) / protected recent tokens"}
    )
    snapkv_kernel: int = field(default=7, metadata={"help": "snapkv score max-pooling kernel (odd, 1=off)"})
    streaming_sinks: int = field(
        default=4, metadata={"help": "streaming: first generated entries always kept"}
    )

    def __post_init__(self):
        self._check_types()
        self._check_ranges()

    # -- validation --------------------------------------------------------------------------
    def _check_types(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in DERIVED:
                continue
            want = _field_kind(f)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                continue
            if isinstance(value, bool) or not isinstance(value, want):
                raise KaraConfigError(
                    f.name, f"expected {want.__name__}, got {type(value).__name__} {value!r}"
                )

    def _check_ranges(self):
        def need(ok: bool, name: str, message: str):
            if not ok:
                raise KaraConfigError(name, message + f" (got {getattr(self, name)!r})")

        need(self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}")
        need(self.query_source in QUERY_SOURCES, "query_source", f"must be one of {', '.join(QUERY_SOURCES)}")
        need(self.scoring in SCORINGS, "scoring", f"must be one of {', '.join(SCORINGS)}")
        need(2 <= self.window <= 65536, "window", "must be an integer in [2, 65536]")
        need(0 <= self.buffer < self.window, "buffer", f"must be in [0, window={self.window}) (W > U)")
        need(self.scoring != "buffer" or self.buffer > 0, "buffer", "must be > 0 with --kara-scoring buffer")
        need(0.0 < self.retention <= 1.0 and math.isfinite(self.retention), "retention", "must be in (0, 1]")
        need(3 <= self.max_chunk <= 65536, "max_chunk", "must be an integer in [3, 65536]")
        k = self.kept_per_window
        if self.chunk_budget is None:
            object.__setattr__(self, "chunk_budget", default_chunk_budget(k))
        need(self.chunk_budget >= 0, "chunk_budget", "must be >= 0")
        need(
            self.policy != "kara" or self.chunk_budget < k,
            "chunk_budget",
            f"must be in [0, ceil(retention*(window-buffer))={k}) so TopK keeps at least one entry",
        )
        need(1 <= self.period <= 1_000_000, "period", "must be an integer in [1, 1000000]")
        need(1 <= self.max_seqs <= 65536, "max_seqs", "must be an integer in [1, 65536]")
        need(1 <= self.snapkv_window <= 65536, "snapkv_window", "must be an integer in [1, 65536]")
        need(
            self.snapkv_window < self.snapkv_budget,
            "snapkv_budget",
            f"must be > snapkv_window={self.snapkv_window}",
        )
        need(
            self.snapkv_budget < self.snapkv_threshold <= 10_000_000,
            "snapkv_threshold",
            f"must be in (snapkv_budget={self.snapkv_budget}, 10000000]",
        )
        need(
            1 <= self.snapkv_kernel <= 63 and self.snapkv_kernel % 2 == 1,
            "snapkv_kernel",
            "must be an odd integer in [1, 63]",
        )
        need(
            0 <= self.streaming_sinks < self.snapkv_budget - self.snapkv_window,
            "streaming_sinks",
            f"must be in [0, snapkv_budget - snapkv_window = {self.snapkv_budget - self.snapkv_window})",
        )

    # -- derived quantities ------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def compressible(self) -> int:
        """W - U: window rows that compression may drop."""
        return self.window - self.buffer

    @property
    def kept_per_window(self) -> int:
        """K_keep: entries kept of the W - U compressible rows."""
        return kept_count(self.window - self.buffer, self.retention)

    @property
    def query_ring_capacity(self) -> int:
        """Queries per request a capture ring keeps: a due window plus the decode steps until its
        event (kara); snapkv's observation window scored every step; nothing for streaming."""
        if self.policy == "kara":
            return self.window + self.period
        if self.policy == "snapkv":
            return self.snapkv_window + 1
        return 0

    @property
    def dropped_per_window(self) -> int:
        return self.compressible - self.kept_per_window

    def replace(self, **changes: Any) -> "KaraConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_prefixed(cls, kwargs: dict) -> tuple["KaraConfig", dict]:
        """Split ``kara_*`` keywords off ``kwargs``; returns (config, the remaining kwargs)."""
        names = {f.name for f in fields(cls)}
        mine, rest = {}, {}
        for key, value in kwargs.items():
            if key.startswith("kara_"):
                name = key[len("kara_"):]
                if name not in names:
                    raise KaraConfigError(name, f"unknown Kara option; known: {', '.join(sorted(names))}")
                mine[name] = value
            else:
                rest[key] = value
        return cls(**mine), rest


def add_cli_args(parser) -> None:
    """Add every ``--kara-*`` flag to an argparse parser (values validated by KaraConfig)."""
    group = parser.add_argument_group("Kara KV compression")
    for f in fields(KaraConfig):
        kind = _field_kind(f)
        group.add_argument(
            flag_name(f.name),
            dest="kara_" + f.name,
            type=_typed(kind, f.name),
            default=f.default,
            help=f"{f.metadata.get('help', '')} (default: {f.default})",
        )


def _typed(kind, name):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise KaraConfigError(name, f"expected {kind.__name__}, got {text!r}") from None

    parse.__name__ = kind.__name__
    return parse


def from_cli_namespace(ns) -> KaraConfig:
    return KaraConfig(**{f.name: getattr(ns, "kara_" + f.name) for f in fields(KaraConfig)})
