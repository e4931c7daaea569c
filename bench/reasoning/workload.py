"""Long answers with checkable parts: several problems answered in sequence in one request.

Pure (no engine, no model). Two workloads (``--workload`` of bench/reasoning/long_answers.py):

**independent**: a request holds ``k`` problems (a seeded shuffle of the problem set, cut into
consecutive groups of ``k``). Its user message is

    Solve each of the following {k} math problems in order, one after another. For each problem,
    start with a line "Problem i:", solve it step by step, and put its final numeric answer
    (without units, currency symbols, or percentage signs) in \\boxed{}, for example: \\boxed{42}.

    Problem 1:
    <question>

    Problem 2:
    ...

so one answer carries ``k`` worked solutions (~200 tokens each from Qwen2.5-Coder-1.5B), and the
problems solved late in the answer are solved over a KV cache that a compressing policy has
already cut several times. Each problem needs the prompt (never compressed) and its own recent
reasoning only, so this workload rewards recency by construction.

**chained**: a request holds base problems and *links* (``CHAIN``: 12 problems, 8 base and 4
links). A link asks for a combination of the answers the model gave to earlier problems, several
problems back ("Let A be your answer to Problem 3 and B your answer to Problem 6. What is A + 2 ×
B?"); the last link combines the earlier links, so the request's final value depends on the whole
chain. The values a link needs were derived in the answer (the prompt holds only their
questions), hundreds to a thousand tokens before the link, so a cache that keeps only recent
tokens must lose them. Golds are exact by construction: each link's gold is its combination of
the referenced problems' golds. Graded per problem (base and links: ``correct``), per link also
*consistent* (its answer equals its combination of the answers the model itself gave to the
referenced problems: the look-up and arithmetic were right even where an earlier answer was
wrong), and on the final value (the last link).

**Grading** (both workloads): the answer is cut at its ``Problem i`` headings (a line starting with
"Problem", markdown emphasis and ``#`` allowed, the number, then one of ``:.*_)``). Each heading
starts a part that runs to the next heading of any number. A part belongs to one problem, wherever
it stands -- never by its position in the answer:

    * a part whose opening restates one problem's question (``restated``: at least 70% of that
      question's words among the part's first words, 20 points clear of every other question)
      belongs to that problem, whatever number its heading gives: a model that lost its place
      and solved problem 7 under a second "Problem 6" heading answered problem 7;
    * any other part belongs to the problem its heading numbers (a number outside 1..k, and text
      before the first heading, belong to no problem);
    * a problem given several parts (a heading repeated before the solution, a solution written
      twice) counts its first part that holds an answer; the others are not graded (a problem
      whose parts hold no answer has none);
    * a problem that no part belongs to has no answer (graded wrong).

Each part is graded as one GSM8K answer (bench/reasoning/grading.py: its last ``\\boxed{}``). An
answer without any heading but with exactly ``k`` boxed answers is read in order.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from bench.reasoning.grading import extract, grade, to_number

INSTRUCTION = (
    "Solve each of the following {k} math problems in order, one after another. For each "
    'problem, start with a line "Problem i:", solve it step by step, and put its final numeric '
    "answer (without units, currency symbols, or percentage signs) in \\boxed{{}}, for example: "
    "\\boxed{{42}}."
)
CHAINED_INSTRUCTION = (
    "Solve each of the following {k} math problems in order, one after another. Some problems "
    "use the answers of earlier problems: for those, use the value you put in \\boxed{{}} for "
    "that earlier problem (do not solve it again). For each problem, start with a line "
    '"Problem i:", solve it step by step, and put its final numeric answer (without units, '
    "currency symbols, or percentage signs) in \\boxed{{}}, for example: \\boxed{{42}}."
)
WORKLOADS = ("independent", "chained")

# The chained request: positions (1-based) of the base problems and the links' references.
# Distances back: 4 and 3; 6 and 3; 7 and 4; the last link 7, 3 and 1 (links only).
CHAIN = {
    "size": 12,
    "links": {5: (1, 2), 9: (3, 6), 11: (4, 7), 12: (5, 9, 11)},
}
LETTERS = "ABC"
COEFFICIENTS = ((1, 1), (1, -1), (2, 1), (1, 2), (3, -1), (1, 3))
FINAL_COEFFICIENTS = ((1, 1, 1), (1, -1, 1), (2, 1, -1), (1, 1, -1), (1, 2, 1))

_HEADING = re.compile(r"(?im)^[ \t>#*_]*problem[ \t]*(\d+)[ \t]*[:.*_)]")


def group(problems: list[dict], per_request: int, seed: int = 0) -> list[list[dict]]:
    """The problems shuffled with ``seed`` and cut into requests of ``per_request`` (the last one
    shorter when the count does not divide)."""
    if per_request < 1:
        raise ValueError(f"per_request must be >= 1, got {per_request}")
    order = list(problems)
    random.Random(seed).shuffle(order)
    return [order[i : i + per_request] for i in range(0, len(order), per_request)]


def base_count(chain: dict = CHAIN) -> int:
    return chain["size"] - len(chain["links"])


def combination(coefficients, values):
    """sum(c * v); None when a value is None."""
    if any(v is None for v in values):
        return None
    return sum(Fraction(c) * Fraction(v) for c, v in zip(coefficients, values))


def expression(coefficients) -> str:
    """``A + 2 × B - C`` for coefficients (1, 2, -1)."""
    out = ""
    for i, c in enumerate(coefficients):
        term = LETTERS[i] if abs(c) == 1 else f"{abs(c)} × {LETTERS[i]}"
        if i == 0:
            out = term if c > 0 else f"-{term}"
        else:
            out += f" {'+' if c > 0 else '-'} {term}"
    return out


def link_question(refs, coefficients) -> str:
    names = [f"{LETTERS[i]} be your answer to Problem {r}" for i, r in enumerate(refs)]
    lets = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    return f"Let {lets}. What is {expression(coefficients)}?"


def chain(
    problems: list[dict], seed: int = 0, chain_spec: dict = CHAIN
) -> list[list[dict]]:
    """Chained requests: the base problems shuffled with ``seed`` and cut into groups of
    ``base_count()``, each request filled in at its base positions, links at the others (their
    coefficients drawn with ``seed``). A group short of base problems is dropped. Each item:
    {"id", "question", "gold", "kind": "base" | "link"}; a link also "refs" (positions) and
    "coefficients"; ids are ``"<request>.<position>"``, the base problem's own id in "source_id"."""
    size, links = chain_spec["size"], chain_spec["links"]
    for pos, refs in links.items():
        if not 1 <= pos <= size or any(not 1 <= r < pos for r in refs):
            raise ValueError(f"link {pos} refers to {refs}: must be earlier positions")
        if not 1 <= len(refs) <= len(LETTERS):
            raise ValueError(f"link {pos}: 1..{len(LETTERS)} references")
    nbase = size - len(links)
    order = list(problems)
    random.Random(seed).shuffle(order)
    rng = random.Random(f"links:{seed}")
    out = []
    for r in range(len(order) // nbase):
        base = iter(order[r * nbase : (r + 1) * nbase])
        items: list[dict] = []
        for pos in range(1, size + 1):
            if pos in links:
                refs = links[pos]
                pool = COEFFICIENTS if len(refs) == 2 else FINAL_COEFFICIENTS
                coeffs = [c for c in pool if len(c) == len(refs)]
                co = rng.choice(coeffs) if coeffs else (1,) * len(refs)
                gold = combination(co, [items[i - 1]["gold"] for i in refs])
                items.append(
                    {
                        "id": f"{r}.{pos}",
                        "kind": "link",
                        "refs": list(refs),
                        "coefficients": list(co),
                        "question": link_question(refs, co),
                        "gold": str(gold),
                    }
                )
            else:
                p = next(base)
                items.append(
                    {
                        "id": f"{r}.{pos}",
                        "kind": "base",
                        "source_id": p["id"],
                        "question": p["question"],
                        "gold": str(Fraction(p["gold"])),
                    }
                )
        out.append(items)
    return out


def message(problems: list[dict], chained: bool | None = None) -> str:
    """The user message of one request (chained when any item is a link, unless told)."""
    if chained is None:
        chained = any(p.get("kind") == "link" for p in problems)
    body = "\n\n".join(
        f"Problem {i}:\n{p['question'].strip()}" for i, p in enumerate(problems, 1)
    )
    head = CHAINED_INSTRUCTION if chained else INSTRUCTION
    return head.format(k=len(problems)) + "\n\n" + body


_WORD = re.compile(r"[a-z0-9]+")
RESTATED = 0.7  # share of a question's words a restatement holds
RESTATED_MARGIN = 0.2  # over every other question's share


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def restated(part: str, questions: list[str]) -> int | None:
    """The index of the one question whose restatement opens ``part`` (its heading line, then
    about as many words as the longest question): the share of that question's distinct words
    found there is at least ``RESTATED`` and ``RESTATED_MARGIN`` above every other question's;
    None otherwise (a part that restates nothing, or questions too alike to tell apart)."""
    qwords = [set(_words(q)) for q in questions]
    if len(qwords) < 2 or not all(qwords):
        return None
    head = set(_words(part)[: max(map(len, qwords)) + 12])
    shares = sorted(
        ((len(q & head) / len(q), i) for i, q in enumerate(qwords)), reverse=True
    )
    (best, i), (second, _) = shares[0], shares[1]
    return i if best >= RESTATED and best - second >= RESTATED_MARGIN else None


def split(text: str, k: int, questions: list[str] | None = None) -> list[str | None]:
    """The answer's part for each of the ``k`` problems (None: no part belongs to it), by the
    rule in the module docstring; ``questions`` (the ``k`` questions as asked) lets a part that
    restates one of them belong to it whatever its heading says."""
    headings = list(_HEADING.finditer(text))
    if not headings:
        boxed = [m.start() for m in re.finditer(r"\\boxed\{", text)]
        if len(boxed) != k:
            return [None] * k
        return [text[b:e] for b, e in zip(boxed, [*boxed[1:], len(text)])]
    parts: list[str | None] = [None] * k
    answered = [False] * k
    for n, m in enumerate(headings):
        end = headings[n + 1].start() if n + 1 < len(headings) else len(text)
        part = text[m.start() : end]
        asked = restated(part, questions) if questions else None
        i = int(m.group(1)) if asked is None else asked + 1
        if not 1 <= i <= k or answered[i - 1]:
            continue
        if extract(part) is not None:
            parts[i - 1], answered[i - 1] = part, True
        elif parts[i - 1] is None:
            parts[i - 1] = (
                part  # a part without an answer, kept until one with an answer comes
            )
    return parts


def grade_request(
    text: str, golds: list[Fraction], questions: list[str] | None = None
) -> list[tuple[bool, str | None]]:
    """(correct, extracted answer) per problem, in the request's order (``questions``: the
    problems as asked, for parts that restate one under another number)."""
    out = []
    for part, gold in zip(split(text, len(golds), questions), golds):
        out.append((False, None) if part is None else grade(part, gold))
    return out


def consistent(items: list[dict], answers: list[str | None]) -> list[bool | None]:
    """Per item: None for a base problem; for a link, whether its answer equals its combination
    of the answers given to the problems it refers to (False when any is missing)."""
    values = [to_number(a) for a in answers]
    out: list[bool | None] = []
    for item, v in zip(items, values):
        if item.get("kind") != "link":
            out.append(None)
            continue
        want = combination(item["coefficients"], [values[r - 1] for r in item["refs"]])
        out.append(v is not None and want is not None and v == want)
    return out
