"""Answers of GSM8K-style problems: extraction from a model's text and comparison with the gold
number. Pure (no engine, no model).

The answer is the content of the last ``\\boxed{...}`` (nested braces allowed); without one, the
number after the last ``####``. Nothing else counts: a text without either has no answer (the
prompt asks for ``\\boxed{}``). The content is reduced to one number -- ``\\text{...}`` units,
``$``, ``\\$``, ``%``, thousands separators, ``\\,`` and a trailing period dropped, ``\\frac{a}{b}``
and ``a/b`` read as fractions -- and compared exactly with the gold answer (``18.00`` == ``18``).

Boxed working: content holding ``=`` is read after its last ``=`` (``\\boxed{64 - 2 \\times 24 = 64
- 48 = 16}`` is 16, ``\\boxed{x = 5}`` is 5): the model wrote its computation into the box and the
value it arrived at comes last. An expression left unevaluated (``\\boxed{64 - 48}``) or content with
several numbers (``3 and 4``) is no single answer and is graded wrong.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, or None (also when its braces never close)."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed{")
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[j:k].strip()
            depth -= 1
    return None


def after_hashes(text: str) -> str | None:
    """What follows the last ``####`` on its line, or None."""
    i = text.rfind("####")
    if i < 0:
        return None
    return text[i + 4 :].split("\n", 1)[0].strip() or None


def extract(text: str) -> str | None:
    """The answer string a model gave: the last boxed content, else the last ``####`` line."""
    boxed = last_boxed(text)
    return boxed if boxed is not None else after_hashes(text)


def to_number(answer: str | None) -> Fraction | None:
    """One number from an answer string, or None when it holds none or several."""
    if answer is None:
        return None
    s = answer.rsplit("=", 1)[-1]  # boxed working: the value after the last "="
    s = re.sub(r"\\text\{[^{}]*\}|\\mbox\{[^{}]*\}", " ", s)
    s = re.sub(r"\\d?frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}", r"\1/\2", s)
    s = (
        s.replace("\\$", " ")
        .replace("$", " ")
        .replace("\\%", " ")
        .replace("%", " ")
        .replace("\\,", "")
    )
    s = s.replace("\\!", "").replace("\\ ", " ").replace("{", " ").replace("}", " ")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    s = s.strip().rstrip(".").strip()
    frac = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*/\s*(-?\d+(?:\.\d+)?)\s*", s)
    if frac:
        den = Fraction(frac.group(2))
        return Fraction(frac.group(1)) / den if den else None
    numbers = _NUMBER.findall(s)
    if len(numbers) != 1:
        return None
    return Fraction(numbers[0])


def gold_number(answer_text: str) -> Fraction:
    """The gold number of a GSM8K solution (``... #### 42``)."""
    value = to_number(after_hashes(answer_text))
    if value is None:
        raise ValueError(f"no gold number after '####' in {answer_text[-80:]!r}")
    return value


def grade(text: str, gold: Fraction) -> tuple[bool, str | None]:
    """(correct, the extracted answer string)."""
    answer = extract(text)
    value = to_number(answer)
    return value is not None and value == gold, answer
