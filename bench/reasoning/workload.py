"""Long answers with checkable parts: several GSM8K problems answered in sequence in one request.

Pure (no engine, no model). A *request* holds ``k`` problems (a seeded shuffle of the problem set,
cut into consecutive groups of ``k``). Its user message is

    Solve each of the following {k} math problems in order, one after another. For each problem,
    start with a line "Problem i:", solve it step by step, and put its final numeric answer
    (without units, currency symbols, or percentage signs) in \\boxed{}, for example: \\boxed{42}.

    Problem 1:
    <question>

    Problem 2:
    ...

so one answer carries ``k`` worked solutions (~200 tokens each from Qwen2.5-Coder-1.5B), and the
problems solved late in the answer are solved over a KV cache that a compressing policy has
already cut several times. Grading is per problem: the answer is split at its ``Problem i``
headings (markdown emphasis and ``#`` allowed; a heading counts when its number is above every
earlier one's, so a problem whose heading is skipped or repeated has no part), and each
part (up to the next ``Problem`` heading of any number) is graded as a single GSM8K answer (bench/reasoning/grading.py: its last ``\\boxed{}``). An
answer without headings but with exactly ``k`` boxed answers is read in order; a problem whose
part is missing has no answer (graded wrong).
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from bench.reasoning.grading import grade

INSTRUCTION = (
    "Solve each of the following {k} math problems in order, one after another. For each "
    'problem, start with a line "Problem i:", solve it step by step, and put its final numeric '
    "answer (without units, currency symbols, or percentage signs) in \\boxed{{}}, for example: "
    "\\boxed{{42}}."
)

_HEADING = re.compile(r"(?im)^[ \t>#*_]*problem[ \t]*(\d+)[ \t]*[:.*_)]")


def group(problems: list[dict], per_request: int, seed: int = 0) -> list[list[dict]]:
    """The problems shuffled with ``seed`` and cut into requests of ``per_request`` (the last one
    shorter when the count does not divide)."""
    if per_request < 1:
        raise ValueError(f"per_request must be >= 1, got {per_request}")
    order = list(problems)
    random.Random(seed).shuffle(order)
    return [order[i : i + per_request] for i in range(0, len(order), per_request)]


def message(problems: list[dict]) -> str:
    """The user message of one request."""
    body = "\n\n".join(
        f"Problem {i}:\n{p['question'].strip()}" for i, p in enumerate(problems, 1)
    )
    return INSTRUCTION.format(k=len(problems)) + "\n\n" + body


def split(text: str, k: int) -> list[str | None]:
    """The answer's part for each of the ``k`` problems (None: not found)."""
    starts: list[tuple[int, int]] = []  # (problem number, offset of its heading)
    headings = list(_HEADING.finditer(text))
    last = 0
    for (
        m
    ) in headings:  # numbers must increase; a skipped or repeated number has no part
        if last < int(m.group(1)) <= k:
            last = int(m.group(1))
            starts.append((last, m.start()))
    if not starts:
        boxed = [m.start() for m in re.finditer(r"\\boxed\{", text)]
        if len(boxed) != k:
            return [None] * k
        return [text[b:e] for b, e in zip(boxed, [*boxed[1:], len(text)])]
    parts: list[str | None] = [None] * k
    for i, at in starts:  # a part ends at the next heading of any number
        end = next((m.start() for m in headings if m.start() > at), len(text))
        parts[i - 1] = text[at:end]
    return parts


def grade_request(text: str, golds: list[Fraction]) -> list[tuple[bool, str | None]]:
    """(correct, extracted answer) per problem, in the request's order."""
    out = []
    for part, gold in zip(split(text, len(golds)), golds):
        out.append((False, None) if part is None else grade(part, gold))
    return out
