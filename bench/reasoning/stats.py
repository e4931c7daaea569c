"""Accuracy statistics: Wilson score interval and the exact (binomial) McNemar test. Pure."""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k / n (n > 0)."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for paired binary outcomes: ``b`` pairs where only the first
    system is right, ``c`` where only the second is. Under the null each discordant pair goes
    either way with probability 1/2: p = min(1, 2 * P[Binomial(b + c, 1/2) <= min(b, c)]); 1.0
    when there are no discordant pairs."""
    if b < 0 or c < 0:
        raise ValueError(f"counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(
    won: int, lost: int, n: int, z: float = Z95
) -> tuple[float, float, float]:
    """(difference, lower, upper): the policy's accuracy minus the reference's on the same ``n``
    problems, (won - lost) / n, with its 95% Wald interval for paired proportions
    (se = sqrt((won + lost) / n - d^2) / sqrt(n))."""
    if n <= 0 or won < 0 or lost < 0 or won + lost > n:
        raise ValueError(f"need 0 <= won + lost <= n and n > 0, got {won}, {lost}, {n}")
    d = (won - lost) / n
    se = math.sqrt(max(0.0, (won + lost) / n - d * d) / n)
    return d, d - z * se, d + z * se


def paired(full: list[bool], other: list[bool]) -> dict:
    """Same problems, full KV vs a policy: ``won`` (policy right, full wrong), ``lost`` (the
    reverse), both right / both wrong, McNemar's p and the paired difference with its 95%
    interval (``diff``, ``diff_lo``, ``diff_hi``: policy minus full KV)."""
    if len(full) != len(other):
        raise ValueError(
            f"paired comparison over different problem sets ({len(full)} vs {len(other)})"
        )
    won = sum(1 for a, b in zip(full, other) if b and not a)
    lost = sum(1 for a, b in zip(full, other) if a and not b)
    both = sum(1 for a, b in zip(full, other) if a and b)
    return {
        "won": won,
        "lost": lost,
        "both_right": both,
        "both_wrong": len(full) - won - lost - both,
        "mcnemar_p": mcnemar_exact(won, lost),
        **dict(
            zip(("diff", "diff_lo", "diff_hi"), paired_difference(won, lost, len(full)))
        ),
    }
