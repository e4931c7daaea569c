"""Policies that differ only in region and score, in one engine, each request served by the one it
names (a benchmark device for the long-answer harness's ``--together``, not a policy to serve).

Why
    Decode on this CPU is bound by reading the weights: answering two policies' requests in one
    engine costs far less than two engines, but an engine serves one policy. ``kara_together`` is
    Kara (schedule, admission footprint, selection) with the region and score of the variant each
    request names; ``threshold_together`` is the threshold baselines' schedule matched to Kara
    (policies/threshold.py) with the region and score of the baseline each request names.

How a request names its variant
    By the digit its Kara retention carries below 0.001: r + i * TAG names variant i (r - i * TAG
    where a tag above r would change K, as when r (W - U) is a whole number), for r a
    multiple of 0.001 (``retention`` for kara_together: 0 is Kara itself, 1... its ``variants``;
    ``match_kara.retention`` for threshold_together: 0... its ``variants``). K = ceil(r (W - U)) is
    the same at every tag (``check_tags``), and nothing else reads r, so each request keeps
    exactly the entries it keeps in an engine of its own variant.

Which policies mix
    kara_together: registered subclasses of Kara that keep its schedule and selection and read no
    tokens (kara_global changes the region, kara_redundancy the score). threshold_together:
    registered threshold baselines that keep its schedule and top-K selection and observe no
    decode (rkv, snapkv, streaming), each with the window the harness gives it alone
    (min(its default, the engine's ``window``)). Any other is refused, naming the field. Run with
    whole events (the harness's ``--kara-spread off``).

Parameters: Kara's or the threshold's (flags --kara-together-<name>, --kara-threshold_together-
<name>), and
    variants   comma-separated registered policies, in tag order
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from sgl_kara.policies.base import (
    OptionError,
    Policy,
    Region,
    RowView,
    ScoreInput,
    need,
    policy_class,
    register,
    request_option,
)
from sgl_kara.policies.kara import KaraOptions, KaraPolicy, KaraSchedule, kept_count
from sgl_kara.policies.threshold import (
    ThresholdOptions,
    ThresholdPolicy,
    ThresholdSchedule,
)

TAG = 1e-4  # retention step between variants: far below 1 / (W - U) for any W <= 1,000
TAGS = 5  # tags 0..4 below each 0.001


def step(compressible: int, retention: float) -> float:
    """TAG, or -TAG where a tag above ``retention`` would change K = ceil(r (W - U)) (r (W - U)
    a whole number or just below one)."""
    k = kept_count(compressible, retention)
    up = all(
        retention + t * TAG <= 1.0
        and kept_count(compressible, round(retention + t * TAG, 6)) == k
        for t in range(TAGS)
    )
    return TAG if up else -TAG


def retention_of(retention: float, tag: int, compressible: int) -> float:
    """The retention by which a request names variant ``tag`` (``retention``: a multiple of
    0.001; ``compressible``: W - U)."""
    return round(retention + tag * step(compressible, retention), 6)


def tag_of(retention: float) -> int:
    """The variant a request's retention names; ValueError when it names none."""
    base = round(retention, 3)
    offset = round((retention - base) / TAG)
    if abs(offset) >= TAGS or round(base + offset * TAG, 6) != round(retention, 6):
        raise ValueError(
            f"retention {retention} names no variant (r +- i * {TAG}, r a multiple of 0.001, "
            f"i in [0, {TAGS - 1}])"
        )
    return abs(offset)


def check_tags(compressible: int, retention: float, tags: int, value) -> None:
    """OptionError naming ``variants`` unless r is a multiple of 0.001 and every tag below
    ``tags`` keeps Kara's K = ceil(r (W - U))."""
    need(
        round(retention, 3) == retention and tags <= TAGS,
        "variants",
        f"tags need r a multiple of 0.001 (r {retention}) and at most {TAGS} tags",
        value,
    )
    k = kept_count(compressible, retention)
    for tag in range(tags):
        r = retention_of(retention, tag, compressible)
        need(
            0.0 < r <= 1.0 and kept_count(compressible, r) == k,
            "variants",
            f"too many for retention {retention}: tag {tag} (r {r}) changes K = {k}",
            value,
        )


def names_of(variants: str) -> list[str]:
    return [n.strip() for n in variants.split(",") if n.strip()]


def mixing(name: str, value: str, base: type, schedule: type, select) -> type:
    """The registered policy ``name`` if it derives from ``base`` and keeps its schedule and
    selection, reads no tokens and observes no decode; else OptionError naming ``variants``."""
    try:
        cls = policy_class(name)
    except ValueError as e:
        raise OptionError("variants", str(e)) from None
    mixes = (
        issubclass(cls, base)
        and cls.Schedule is schedule
        and cls.select is select
        and not cls.needs_tokens
        and not cls.observes_decode
        and not issubclass(cls, ByTag)
    )
    need(
        mixes,
        "variants",
        f"{name} must derive from {base.__name__} and keep its schedule and selection (no "
        "tokens, no decode observation)",
        value,
    )
    return cls


class ByTag:
    """Region and score of ``variants[tag(row)]`` (None: the next class's own)."""

    variants: list

    def tag(self, row: RowView) -> int:
        raise NotImplementedError

    def chosen(self, row: RowView):
        tag = self.tag(row)
        if tag >= len(self.variants):
            raise ValueError(
                f"{self.name}: tag {tag} names no variant (of {len(self.variants)})"
            )
        return self.variants[tag]

    def region(self, row: RowView) -> Region | None:
        v = self.chosen(row)
        return super().region(row) if v is None else v.region(row)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        tags = [self.tag(row) for row in inp.rows]
        if len(set(tags)) == 1:
            return self._score(tags[0], inp)
        out = None
        for tag in sorted(set(tags)):
            idx = [b for b, t in enumerate(tags) if t == tag]
            ix = torch.tensor(idx, device=inp.slots.device)
            part = dataclasses.replace(
                inp,
                queries=None if inp.queries is None else inp.queries[ix],
                slots=inp.slots[ix],
                rows=[inp.rows[b] for b in idx],
                regions=[inp.regions[b] for b in idx],
            )
            s = self._score(tag, part)
            if out is None:
                out = s.new_empty((len(tags), *s.shape[1:]))
            out[ix] = s
        return out

    def _score(self, tag: int, inp: ScoreInput) -> torch.Tensor:
        v = self.variants[tag]
        return super().score(inp) if v is None else v.score(inp)


@dataclass(frozen=True)
class TogetherOptions(KaraOptions):
    variants: str = field(
        default="",
        metadata={"help": "comma-separated registered Kara variants, in tag order"},
    )

    def __post_init__(self):
        super().__post_init__()
        check_tags(
            self.compressible, self.retention, len(self.names) + 1, self.variants
        )

    @property
    def names(self) -> list[str]:
        return names_of(self.variants)


@register
class KaraTogetherPolicy(ByTag, KaraPolicy):
    """Kara's schedule and selection; each request's region and score are its variant's."""

    name = "kara_together"
    prefix = "together_"
    Options = TogetherOptions
    additive = False  # a variant's score need not be

    def __init__(self, options):
        super().__init__(options)
        kara = {
            f.name: getattr(options, f.name) for f in dataclasses.fields(KaraOptions)
        }
        self.variants = [None]
        for n in options.names:
            cls = mixing(
                n, options.variants, KaraPolicy, KaraSchedule, KaraPolicy.select
            )
            self.variants.append(cls(cls.Options(**kara)))

    def tag(self, row: RowView) -> int:
        r = request_option(row.state, "retention")
        return 0 if r is None else tag_of(r)

    def window_region(self, row: RowView) -> Region:
        v = self.chosen(row)
        return super().window_region(row) if v is None else v.window_region(row)


@dataclass(frozen=True)
class ThresholdTogetherOptions(ThresholdOptions):
    variants: str = field(
        default="",
        metadata={
            "help": "comma-separated registered threshold baselines, in tag order"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            len(names_of(self.variants)) <= TAGS,
            "variants",
            f"must name at most {TAGS} policies",
            self.variants,
        )


@register
class ThresholdTogetherPolicy(ByTag, ThresholdPolicy):
    """The threshold schedule matched to Kara; each request's region and score are those of the
    baseline its ``match_kara.retention`` names."""

    name = "threshold_together"
    prefix = "threshold_together_"
    Options = ThresholdTogetherOptions

    def __init__(self, options):
        super().__init__(options)
        need(bool(names_of(options.variants)), "variants", "names no policy", "")
        self.variants = []
        for n in names_of(options.variants):
            cls = mixing(
                n, options.variants, ThresholdPolicy, ThresholdSchedule, Policy.select
            )
            fields = {f.name: f.default for f in dataclasses.fields(cls.Options)}
            w = max(1, min(fields.get("window", options.window), options.window))
            gap = options.threshold - options.budget
            self.variants.append(
                cls(cls.Options(window=w, budget=w + 8, threshold=w + 8 + gap))
            )

    def tag(self, row: RowView) -> int:
        spec = request_option(row.state, "match_kara")
        if spec is None:
            raise ValueError(
                f"{self.name}: a request names its baseline by custom_params.kara.match_kara"
            )
        return tag_of(spec["retention"])
