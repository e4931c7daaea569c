"""Per-request Kara options: ``sampling_params.custom_params = {"kara": {...}}``.

    {"kara": {"enable": false}}        this request is never compressed
    {"kara": {"retention": 0.5}}       Kara (and random): keep this fraction of each window
                                       (overrides --kara-retention)
    {"kara": {"budget": 300}}          the threshold baselines (snapkv, streaming, h2o, rkv):
                                       generated KV kept for this request (budget matching;
                                       the threshold keeps its configured gap)
    {"kara": {"match_kara": {"window": 256, "buffer": 32, "retention": 0.2, "period": 32,
              "recent": 0}}}           the threshold baselines: follow Kara's generated KV at
                                       every decode step (policies/trajectory.py; ``recent``
                                       optional, default 0); not with ``budget``

Which policies take an option is each policy's ``request_options`` (sgl_kara/policies); the
messages name them from there. Validated in the tokenizer process (a ValueError becomes an HTTP
400 naming the field); the scheduler reads the already-validated dict and refuses an option the
served policy does not take. With ``retention`` below what the configured chunk budget needs,
that request's Token2Chunk budget shrinks to ``K - 1`` (its retention is honoured). No SGLang
import.
"""

from __future__ import annotations

import math

from sgl_kara.policies import base as policy_base

KEY = "kara"
RANGES = {
    "enable": "bool",
    "retention": "float in (0, 1]",
    "budget": "int in [2, 10000000]",
    "match_kara": "object {window, buffer, retention, period, recent}",
}
# the fields a policy may take (its ``request_options``), kept in ``KaraReqState.request``
PER_REQUEST = tuple(name for name in RANGES if name != "enable")
# match_kara's fields: type and range, as Kara's own options check them (policies/kara.py)
MATCH_FIELDS = {
    "window": "int in [2, 65536]",
    "buffer": "int in [0, window)",
    "retention": "float in (0, 1]",
    "period": "int in [1, 1000000]",
    "recent": "int in [0, 1000000] (optional, default 0)",
}


def accepting(name: str) -> list[str]:
    """The policies that take the per-request option ``name`` (their ``request_options``)."""
    return [p.name for p in policy_base.policies() if name in p.request_options]


def fields() -> dict[str, str]:
    """Each field, its type and range, and the policies that take it (``enable``: every policy)."""
    return {
        name: f"{kind} ({'/'.join(accepting(name)) or 'every policy'})"
        if name != "enable"
        else kind
        for name, kind in RANGES.items()
    }


def validate(custom_params) -> dict:
    """Returns the validated ``kara`` options (empty when absent); raises ValueError."""
    if not isinstance(custom_params, dict) or KEY not in custom_params:
        return {}
    opts = custom_params[KEY]
    if not isinstance(opts, dict):
        raise ValueError(
            f"custom_params.kara must be an object with fields {fields()}, got {type(opts).__name__}"
        )
    unknown = sorted(set(opts) - set(RANGES))
    if unknown:
        raise ValueError(
            f"custom_params.kara has unknown field(s) {unknown}; accepted: {fields()}"
        )
    if "enable" in opts and not isinstance(opts["enable"], bool):
        raise ValueError(
            f"custom_params.kara.enable must be a bool, got {opts['enable']!r}"
        )
    if "retention" in opts:
        r = opts["retention"]
        if (
            isinstance(r, bool)
            or not isinstance(r, (int, float))
            or not math.isfinite(r)
            or not 0.0 < r <= 1.0
        ):
            raise ValueError(
                f"custom_params.kara.retention must be a number in (0, 1], got {r!r}"
            )
    if "budget" in opts:
        n = opts["budget"]
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 10_000_000:
            raise ValueError(
                f"custom_params.kara.budget must be an integer in [2, 10000000], got {n!r}"
            )
    if "match_kara" in opts:
        opts = dict(opts, match_kara=validate_match(opts["match_kara"]))
        if "budget" in opts:
            raise ValueError(
                "custom_params.kara.match_kara and custom_params.kara.budget both set the "
                "baseline's KV; give one"
            )
    if opts.get("enable") is False and len(opts) > 1:
        # A contradiction, not a preference: refuse it rather than silently ignore the rest.
        ignored = sorted(set(opts) - {"enable"})
        raise ValueError(
            f"custom_params.kara.enable is false, so {ignored} would have no effect; drop them or enable compression"
        )
    return dict(opts)


def validate_match(spec) -> dict:
    """``custom_params.kara.match_kara`` checked field by field: the dict with ``recent``
    filled in; raises ValueError naming the field and its range."""
    from sgl_kara.policies.base import OptionError
    from sgl_kara.policies.trajectory import schedule_of

    where = "custom_params.kara.match_kara"
    if not isinstance(spec, dict):
        raise ValueError(
            f"{where} must be an object with fields {MATCH_FIELDS}, got {type(spec).__name__}"
        )
    unknown = sorted(set(spec) - set(MATCH_FIELDS))
    missing = sorted(set(MATCH_FIELDS) - {"recent"} - set(spec))
    if unknown or missing:
        raise ValueError(
            f"{where}: unknown field(s) {unknown}, missing field(s) {missing}; "
            f"accepted: {MATCH_FIELDS}"
        )
    for name, value in spec.items():
        ok = (
            isinstance(value, (int, float)) and math.isfinite(value)
            if name == "retention"
            else isinstance(value, int)
        )
        if isinstance(value, bool) or not ok:
            raise ValueError(
                f"{where}.{name} must be {MATCH_FIELDS[name]}, got {value!r}"
            )
    try:
        schedule = schedule_of(spec)
    except OptionError as e:
        raise ValueError(
            f"{where}.{e.field} must be {MATCH_FIELDS[e.field]}: {e}"
        ) from None
    return {
        "window": schedule.window,
        "buffer": schedule.buffer,
        "retention": float(schedule.retention),
        "period": schedule.period,
        "recent": schedule.recent,
    }


def check_supported(sampling_params, policy: str) -> None:
    """Per-request features the compression runtime does not support (raises ValueError -> 400)."""
    beam = getattr(sampling_params, "beam_width", None)
    if beam is not None and beam > 1:
        raise ValueError(
            f"beam_width={beam} (beam search) is not supported with --kara-policy {policy}: "
            "beam rows share one request's KV, which compression rewrites"
        )
