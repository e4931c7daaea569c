"""Per-request Kara options: ``sampling_params.custom_params = {"kara": {...}}``.

    {"kara": {"enable": false}}        this request is never compressed
    {"kara": {"retention": 0.5}}       keep this fraction of each window (overrides --kara-retention)

Validated in the tokenizer process (a ValueError becomes an HTTP 400 naming the field); the
scheduler reads the already-validated dict. With ``retention`` below what the configured chunk
budget needs, that request's Token2Chunk budget shrinks to ``K - 1`` (its retention is honoured).
No SGLang import.
"""

from __future__ import annotations

import math

KEY = "kara"
FIELDS = {"enable": "bool", "retention": "float in (0, 1]"}


def validate(custom_params) -> dict:
    """Returns the validated ``kara`` options (empty when absent); raises ValueError."""
    if not isinstance(custom_params, dict) or KEY not in custom_params:
        return {}
    opts = custom_params[KEY]
    if not isinstance(opts, dict):
        raise ValueError(f"custom_params.kara must be an object with fields {FIELDS}, got {type(opts).__name__}")
    unknown = sorted(set(opts) - set(FIELDS))
    if unknown:
        raise ValueError(f"custom_params.kara has unknown field(s) {unknown}; accepted: {FIELDS}")
    if "enable" in opts and not isinstance(opts["enable"], bool):
        raise ValueError(f"custom_params.kara.enable must be a bool, got {opts['enable']!r}")
    if "retention" in opts:
        r = opts["retention"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 < r <= 1.0:
            raise ValueError(f"custom_params.kara.retention must be a number in (0, 1], got {r!r}")
    return dict(opts)
