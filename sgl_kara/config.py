"""KaraConfig: the one frozen, validated configuration of sgl_kara.

Common knobs plus the selected policy's own options (``sgl_kara.policies``: each policy declares
and validates its ``Options``). Every knob has one name, used three ways:

    CLI flag ``--kara-<name-with-dashes>``, Engine keyword ``kara_<name>``, flat name ``<name>``

where a policy's option names carry its prefix: Kara's are bare (``window``, ``retention``, ...),
the others' are ``<policy>_<option>`` (``snapkv_budget``, ``streaming_sinks``, ...). Setting an
option of a policy other than the selected one is an error (it would be silently ignored).

Defaults: W=512, U=32, r=0.25, alpha=min(16, K/2), gamma=8, delta=128 per request, max_seqs=30;
SnapKV-threshold C_max=1280 -> N=1024, w=32, kernel 7. Where they follow the Kara paper's accuracy
settings (App. B.3) or its serving settings (App. B.1), and where not: docs/CONFIGURATION.md,
"The paper's settings and ours".

This module imports nothing from SGLang, mem_cache or scheduler.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from sgl_kara.policies import base as policy_base
from sgl_kara.policies.base import OptionError
from sgl_kara.policies.kara import kept_count  # noqa: F401  (re-exported: K of a window)

NONE = "none"  # plain SGLang: no compression
QUERY_SOURCES = ("auto", "recompute", "capture")
TRIGGERS = ("schedule", "pressure", "headroom")
PHASES = ("request", "server")
SPREADS = ("even", "off")


def policy_names() -> tuple[str, ...]:
    return (*policy_base.names(), NONE)


class KaraConfigError(ValueError):
    """A Kara option is invalid. ``flag`` names the CLI flag, the message the accepted range."""

    def __init__(self, name: str, message: str):
        self.name = name
        self.flag = flag_name(name)
        super().__init__(f"{self.flag} (kara_{name}): {message}")


def flag_name(name: str) -> str:
    return "--kara-" + name.replace("_", "-")


COMMON_HELP = {
    "policy": "compression policy: {policies} (the settings to use per workload: docs/CONFIGURATION.md, Recommended settings)",
    "query_source": f"window queries: {', '.join(QUERY_SOURCES)} (auto: capture on CPU, recompute on CUDA unless "
    "the ring is small; resolved at start-up)",
    "query_ring_rows": "capture ring rows at most (0: one per request that can run at once, bounded by the "
    "pool); auto judges the capped ring; a running request without a row is scored from a "
    "recompute forward",
    "max_seqs": "N: max requests compressed per event, unless more are overdue (their tails would outgrow "
    "what admission charged before the next event; the paper's serving: 30)",
    "trigger": f"when due events run: {', '.join(TRIGGERS)} (schedule: always, the paper's periodic policy; pressure: "
    "only while memory binds -- requests wait for admission, or the pool cannot take the running "
    "requests' growth until the next due step; headroom: only while requests wait for admission or "
    "the pool cannot take the running requests' whole uncompressed remainder)",
    "phase": f"whose decode steps a policy's period counts: {', '.join(PHASES)} (request: each request's own generated "
    "tokens, so when a request is compressed, and its answer, does not depend on when it arrived or what "
    "else runs; server: the scheduler's step, every request in step as in the paper: fewer, larger events)",
    "spread": f"when a window is scored: {', '.join(SPREADS)} (even: in parts of at least 32 queries on a CPU, 256 "
    "on CUDA (fewer only where fewer are left or decoded), spread over the decode steps from when its "
    "keys are all decoded until its due step, so no step carries a whole window's scoring; off: all at "
    "its due step, the paper's; applies to additive scorers: kara)",
    "spread_max": "most queries of one request's window scored per decode step under --kara-spread even, on every step (0: no cap, "
    "events never delayed; a cap too small to finish by the due step moves the event to a later due "
    "step, and admission charges the rows held meanwhile)",
}


@dataclass(frozen=True)
class KaraConfig:
    policy: str = "kara"
    query_source: str = "auto"
    query_ring_rows: int = 0
    max_seqs: int = 30
    trigger: str = "schedule"
    phase: str = "request"
    spread: str = "even"
    spread_max: int = 0
    options: Any = field(
        default=None, compare=True
    )  # the selected policy's Options (None: its defaults)

    def __post_init__(self):
        for name, kind in COMMON_TYPES.items():
            _check_type(name, getattr(self, name), kind)
        if self.policy not in policy_names():
            raise KaraConfigError(
                "policy",
                f"must be one of {', '.join(policy_names())} (got {self.policy!r})",
            )
        if self.query_source not in QUERY_SOURCES:
            raise KaraConfigError(
                "query_source",
                f"must be one of {', '.join(QUERY_SOURCES)} (got {self.query_source!r})",
            )
        if not 0 <= self.query_ring_rows <= 65536:
            raise KaraConfigError(
                "query_ring_rows",
                f"must be an integer in [0, 65536] (got {self.query_ring_rows!r})",
            )
        if self.query_ring_rows and self.query_source == "recompute":
            raise KaraConfigError(
                "query_ring_rows",
                "applies to --kara-query-source capture or auto, not recompute",
            )
        if not 1 <= self.max_seqs <= 65536:
            raise KaraConfigError(
                "max_seqs", f"must be an integer in [1, 65536] (got {self.max_seqs!r})"
            )
        if self.trigger not in TRIGGERS:
            raise KaraConfigError(
                "trigger",
                f"must be one of {', '.join(TRIGGERS)} (got {self.trigger!r})",
            )
        if self.phase not in PHASES:
            raise KaraConfigError(
                "phase", f"must be one of {', '.join(PHASES)} (got {self.phase!r})"
            )
        if self.spread not in SPREADS:
            raise KaraConfigError(
                "spread", f"must be one of {', '.join(SPREADS)} (got {self.spread!r})"
            )
        if not 0 <= self.spread_max <= 65536:
            raise KaraConfigError(
                "spread_max",
                f"must be an integer in [0, 65536] (got {self.spread_max!r})",
            )
        if self.spread_max and self.spread == "off":
            raise KaraConfigError(
                "spread_max", "applies to --kara-spread even, not off"
            )
        if self.enabled and self.options is None:
            object.__setattr__(self, "options", _build_options(self.policy_class, {}))

    # -- derived ----------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.policy != NONE

    @property
    def policy_class(self):
        return policy_base.policy_class(self.policy)

    def make_policy(self):
        return self.policy_class(self.options)

    @property
    def query_ring_capacity(self) -> int:
        """Queries per request a capture ring keeps for this policy (0: it scores without them)."""
        if not self.enabled:
            return 0
        return self.make_policy().schedule.query_capacity()

    def flat(self) -> dict:
        """Every knob of this config by flat name (common + the selected policy's options)."""
        out = {name: getattr(self, name) for name in COMMON_TYPES}
        if self.options is not None:
            prefix = self.policy_class.prefix
            out.update(
                {
                    prefix + f.name: getattr(self.options, f.name)
                    for f in fields(self.options)
                }
            )
        return out

    def to_dict(self) -> dict:
        """Plain data for the scheduler process (``KaraConfig.build(**d)`` rebuilds it)."""
        return self.flat()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, **flat) -> KaraConfig:
        """From flat names: common knobs and options of the selected policy (others refused)."""
        policy = flat.pop("policy", "kara")
        common = {k: flat.pop(k) for k in COMMON_TYPES if k != "policy" and k in flat}
        cfg = cls(policy=policy, **common)  # validates the policy name first
        if not cfg.enabled:
            if flat:
                name = next(iter(flat))
                raise KaraConfigError(
                    name, f"applies to a compression policy, not --kara-policy {NONE}"
                )
            return cfg
        pcls = cfg.policy_class
        mine = {}
        for name, value in flat.items():
            owner = _owner(name)
            if owner is None:
                raise KaraConfigError(
                    name,
                    f"unknown Kara option; known: {', '.join(sorted(all_option_names()))}",
                )
            if owner is not pcls:
                raise KaraConfigError(
                    name, f"applies to --kara-policy {owner.name}, not {policy}"
                )
            mine[name[len(pcls.prefix) :]] = value
        return dataclasses.replace(cfg, options=_build_options(pcls, mine))

    @classmethod
    def from_prefixed(cls, kwargs: dict) -> tuple[KaraConfig, dict]:
        """Split ``kara_*`` keywords off ``kwargs``; returns (config, the remaining kwargs)."""
        mine, rest = {}, {}
        for key, value in kwargs.items():
            if key.startswith("kara_"):
                mine[key[len("kara_") :]] = value
            else:
                rest[key] = value
        return cls.build(**mine), rest


# The knobs every policy shares (flat names = field names), in CLI order.
COMMON_TYPES = {
    "policy": str,
    "query_source": str,
    "query_ring_rows": int,
    "max_seqs": int,
    "trigger": str,
    "phase": str,
    "spread": str,
    "spread_max": int,
}


def _owner(name: str):
    """The policy class whose option this flat name is (None: no policy's); longest prefix first."""
    for pcls in sorted(policy_base.policies(), key=lambda p: -len(p.prefix)):
        if name.startswith(pcls.prefix) and name[len(pcls.prefix) :] in {
            f.name for f in fields(pcls.Options)
        }:
            return pcls
    return None


def all_option_names() -> list[str]:
    names = list(COMMON_TYPES)
    for pcls in policy_base.policies():
        names += [pcls.prefix + f.name for f in fields(pcls.Options)]
    return names


def _build_options(pcls, values: dict):
    hints = typing.get_type_hints(pcls.Options)
    for f in fields(pcls.Options):
        if f.name in values:
            values[f.name] = _check_type(
                pcls.prefix + f.name, values[f.name], hints[f.name]
            )
    try:
        return pcls.Options(**values)
    except OptionError as e:
        raise KaraConfigError(pcls.prefix + e.field, str(e)) from None


def _check_type(name: str, value, want):
    """``value`` as type ``want`` (int, float, str, or ``X | None``); ints pass as floats."""
    allowed = typing.get_args(want) if isinstance(want, types.UnionType) else (want,)
    if value is None and type(None) in allowed:
        return value
    kind = next(t for t in allowed if t is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise KaraConfigError(
            name, f"expected {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


# ------------------------------------------------------------------------------------ CLI
def _cli_fields():
    """(flat name, type, default, help) of every knob of every registered policy."""
    defaults = KaraConfig.__dataclass_fields__
    out = [
        (
            name,
            kind,
            defaults[name].default,
            COMMON_HELP[name].format(policies=", ".join(policy_names()))
            if name == "policy"
            else COMMON_HELP[name],
        )
        for name, kind in COMMON_TYPES.items()
    ]
    for pcls in policy_base.policies():
        hints = typing.get_type_hints(pcls.Options)
        for f in fields(pcls.Options):
            want = hints[f.name]
            kind = (
                next(t for t in typing.get_args(want) if t is not type(None))
                if isinstance(want, types.UnionType)
                else want
            )
            help_text = f.metadata.get("help", "")
            out.append(
                (pcls.prefix + f.name, kind, f.default, f"[{pcls.name}] {help_text}")
            )
    return out


def add_cli_args(parser) -> None:
    """Add every ``--kara-*`` flag to an argparse parser (values validated by KaraConfig)."""
    group = parser.add_argument_group("Kara KV compression")
    for name, kind, default, help_text in _cli_fields():
        group.add_argument(
            flag_name(name),
            dest="kara_" + name,
            type=_typed(kind, name),
            default=None,
            help=f"{help_text} (default: {default})",
        )


def _typed(kind, name):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise KaraConfigError(
                name, f"expected {kind.__name__}, got {text!r}"
            ) from None

    parse.__name__ = kind.__name__
    return parse


def from_cli_namespace(ns) -> KaraConfig:
    """Only the flags the user gave (argparse defaults are None) reach KaraConfig.build."""
    given = {
        name: getattr(ns, "kara_" + name)
        for name, *_ in _cli_fields()
        if getattr(ns, "kara_" + name) is not None
    }
    return KaraConfig.build(**given)
