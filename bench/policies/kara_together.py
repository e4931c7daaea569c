"""Kara and variants of it in one engine, each request served by the one it names (a benchmark
device for the long-answer harness's ``--together``, not a policy to serve).

Why
    Decode on this CPU is bound by reading the weights: answering two policies' requests in one
    engine costs far less than two engines, but an engine serves one policy. This one is Kara
    (schedule, admission footprint, selection) whose region and score are those of the variant
    each request names.

How a request names its variant
    By its retention: a request of variant i (1-based in ``variants``) asks r + i * TAG, a request
    asking r itself (or nothing) is Kara's. K = ceil(r (W - U)) is the same at every tag (checked
    when the options are built, for every variant), and nothing else reads r, so each request
    keeps exactly the entries it keeps in an engine of its own variant.

Which policies mix
    Registered subclasses of Kara that keep its schedule and its selection and read no tokens:
    they change the region (kara_global) or the score (kara_redundancy). Any other is refused,
    naming the field. Run with whole events (the harness's ``--kara-spread off``).

Parameters: Kara's (flags --kara-together-<name>), and
    variants   comma-separated registered policies, in tag order (none: Kara alone)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from sgl_kara.policies.base import (
    OptionError,
    Region,
    RowView,
    ScoreInput,
    need,
    policy_class,
    register,
    request_option,
)
from sgl_kara.policies.kara import KaraOptions, KaraPolicy, KaraSchedule, kept_count

TAG = 1e-4  # retention step between variants: far below 1 / (W - U) for any W <= 1,000


def retention_of(retention: float, tag: int) -> float:
    """The per-request retention by which a request names variant ``tag`` (0: Kara)."""
    return round(retention + tag * TAG, 6)


@dataclass(frozen=True)
class TogetherOptions(KaraOptions):
    variants: str = field(
        default="",
        metadata={"help": "comma-separated registered Kara variants, in tag order"},
    )

    def __post_init__(self):
        super().__post_init__()
        for tag in range(1, len(self.names) + 1):
            r = retention_of(self.retention, tag)
            need(
                r <= 1.0 and kept_count(self.compressible, r) == self.kept_per_window,
                "variants",
                f"too many for retention {self.retention}: tag {tag} (r {r}) changes "
                f"K = {self.kept_per_window}",
                self.variants,
            )

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in self.variants.split(",") if n.strip()]


def variant(name: str, options: TogetherOptions) -> KaraPolicy:
    """The registered policy ``name``, built on ``options``' Kara settings; OptionError naming
    ``variants`` when it cannot share an engine with Kara."""
    try:
        cls = policy_class(name)
    except ValueError as e:
        raise OptionError("variants", str(e)) from None
    mixes = (
        issubclass(cls, KaraPolicy)
        and cls.Schedule is KaraSchedule
        and cls.select is KaraPolicy.select
        and not cls.needs_tokens
        and not cls.observes_decode
        and cls is not KaraTogetherPolicy
    )
    need(
        mixes,
        "variants",
        f"{name} must derive from kara and keep its schedule and selection "
        "(no tokens, no decode observation)",
        options.variants,
    )
    kara = {f.name: getattr(options, f.name) for f in dataclasses.fields(KaraOptions)}
    return cls(cls.Options(**kara))


@register
class KaraTogetherPolicy(KaraPolicy):
    """Kara's schedule and selection; each request's region and score are its variant's."""

    name = "kara_together"
    prefix = "together_"
    Options = TogetherOptions
    additive = False  # a variant's score need not be
    retention_of = staticmethod(retention_of)

    def __init__(self, options):
        super().__init__(options)
        self.variants = [None] + [variant(n, options) for n in options.names]

    def tag(self, row: RowView) -> int:
        """The variant ``row``'s request names (0: Kara); ValueError for a retention naming none."""
        r = request_option(row.state, "retention")
        if r is None:
            return 0
        tag = round((r - self.options.retention) / TAG)
        if not 0 <= tag < len(self.variants) or r != retention_of(
            self.options.retention, tag
        ):
            raise ValueError(
                f"kara_together: retention {r} names no variant (r + i * {TAG}, i in "
                f"[0, {len(self.variants) - 1}], r {self.options.retention})"
            )
        return tag

    def window_region(self, row: RowView) -> Region:
        tag = self.tag(row)
        if tag == 0:
            return super().window_region(row)
        return self.variants[tag].window_region(row)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        tags = [self.tag(row) for row in inp.rows]
        if len(set(tags)) == 1:
            return self._score(tags[0], inp)
        out = None
        for tag in sorted(set(tags)):
            idx = [b for b, t in enumerate(tags) if t == tag]
            ix = torch.tensor(idx, device=inp.slots.device)
            part = ScoreInput(
                inp.layer,
                None if inp.queries is None else inp.queries[ix],
                inp.k_buffer,
                inp.slots[ix],
                [inp.rows[b] for b in idx],
                [inp.regions[b] for b in idx],
                inp.head_offset,
                inp.model_heads,
            )
            s = self._score(tag, part)
            if out is None:
                out = s.new_empty((len(tags), *s.shape[1:]))
            out[ix] = s
        return out

    def _score(self, tag: int, inp: ScoreInput) -> torch.Tensor:
        if tag == 0:
            return super().score(inp)
        return self.variants[tag].score(inp)
