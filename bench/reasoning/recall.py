"""How a chained answer restates the earlier answers a link refers to -- the mechanism behind a
link's consistency, read from the answer's text. No engine.

A link asks "Let A be your answer to Problem 2 and B ... What is A + 3 × B?" (workload.py). An
answer usually restates each value before combining them ("From Problem 2, A = 40"); each
reference of each link is one of

    exact          the first number stated for its letter ("A = 40", "\\( A = 40 \\)") is the
                   answer the model gave to that problem
    one digit off  it differs from that answer by one digit inserted, dropped or changed ("42"
                   for "40"): a number read back from a cache that kept part of its digits
    other          another value
    not stated     no number follows the letter's "=" in the link's part (the model derives it
                   again, or answers without restating it)
    no answer      the referenced problem has no answer, or the link no part

The counts are a diagnosis, not a grade: grading (grading.py, workload.py) does not read them.
"""

from __future__ import annotations

import re
from collections import Counter

from bench.reasoning import workload
from bench.reasoning.grading import to_number

KINDS = ("exact", "one digit off", "other", "not stated", "no answer")
_NUMBER = r"(-?\d[\d,]*(?:\.\d+)?)"


def stated_value(part: str, letter: str) -> str | None:
    """The first number stated for ``letter`` in ``part`` ("A = 40", "\\( A = 40 \\)",
    "A = $1,200"), commas removed; None when none is."""
    m = re.search(rf"(?<![A-Za-z]){letter}\s*(?:\\\))?\s*=\s*\\?\$?\s*{_NUMBER}", part)
    return None if m is None else m.group(1).replace(",", "")


def edit_distance_is_one(a: str, b: str) -> bool:
    """Do ``a`` and ``b`` differ by exactly one character inserted, dropped or changed?"""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1 :] == short for i in range(len(long_)))


def _digits(value) -> str:
    """A value's canonical digits: a whole number as an integer, else its decimal form."""
    if value.denominator == 1:
        return str(value.numerator)
    return str(float(value))


def classify(stated: str | None, own: str | None) -> str:
    """One reference's kind (KINDS) from the stated number and the model's own answer."""
    own_value = to_number(own)
    if own_value is None:
        return "no answer"
    if stated is None:
        return "not stated"
    value = to_number(stated)
    if value is None:
        return "not stated"
    if value == own_value:
        return "exact"
    a, b = _digits(abs(value)), _digits(abs(own_value))
    same_sign = (value < 0) == (own_value < 0)
    return "one digit off" if same_sign and edit_distance_is_one(a, b) else "other"


def restatements(text: str, items: list[dict], answers: list[str | None]) -> list[str]:
    """Per reference of each link of one chained answer, in order: its kind (KINDS)."""
    questions = [item.get("question") for item in items]
    parts = workload.split(text, len(items), questions if all(questions) else None)
    out = []
    for item, part in zip(items, parts):
        if item.get("kind") != "link":
            continue
        for i, ref in enumerate(item["refs"]):
            if part is None:
                out.append("no answer")
                continue
            letter = workload.LETTERS[i]
            out.append(classify(stated_value(part, letter), answers[ref - 1]))
    return out


def count(rows: list[dict], texts: dict[int, str], items_of) -> Counter:
    """KINDS counted over a result's requests (``rows``: its per-request records; ``texts``:
    request -> answer text; ``items_of(row)``: the request's items with kind and refs)."""
    out: Counter = Counter()
    for r in rows:
        text = texts.get(r["request"])
        if text is None:
            continue
        out.update(restatements(text, items_of(r), r["answers"]))
    return out
