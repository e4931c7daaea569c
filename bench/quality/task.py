"""Variable-tracking chain task: the reasoning proxy's training and evaluation data (pure Python).

A problem is a set of N assignments ``name := a op b`` (op in {+, -}, arithmetic mod 10), each
operand a digit or an earlier-assigned name, listed in the prompt in **shuffled** order, then a
query of three names and the start name. Names are consecutive, ``v{s}, v{s+1}, ...`` (mod 64)
from a random start s, so "which name comes next" is a fixed successor rule while the formulas
must be looked up in the shuffled prompt by name. Every name is assigned exactly once (no
reassignment), and every name except the last is used by a later one, so the last value depends
on all of them. The solution evaluates the names in order, one step per name, writing each
fetched value next to its name:

    prompt   : v42 := v40 - v41 ; v40 := 3 + 5 ; v41 := v40 + 7 ; query v42 v40 v41 ; start v40 solve
    solution : v40 := 3 + 5 ; 3 + 5 = 8 ; v40 = 8 .
               v41 := v40 + 7 ; v40 = 8 ; 8 + 7 = 5 ; v41 = 5 .
               v42 := v40 - v41 ; v40 = 8 ; v41 = 5 ; 8 - 5 = 3 ; v42 = 3 .
               answer v42 = 3 ; v40 = 8 ; v41 = 5

(the solution is one line; breaks added here). Every ``name = digit`` pair in the whole sequence
states that name's value, so a value is fetched by its name (content-addressed), never by
position, and the distance back varies from one step to hundreds of tokens: one operand is
usually a recently computed, not-yet-used name, the other is uniform over all earlier names.
Values exist only in the generated text (the prompt holds formulas, never ``name = digit``), so a
KV-cache policy that drops the wrong generated entries breaks the chain. The answer is the three
queried values (the last name plus two from the first half, fetched again at the very end), so
guessing succeeds with probability 1/1000.

Size N = number of steps; solution length is about 21.5 * N + 12 tokens (N=14 -> ~310,
N=44 -> ~960). Tokens are separated by single spaces (word-level vocabulary, see tokenizer.py).
"""

from __future__ import annotations

import random
import re

MAX_NAMES = 64
NAMES = [f"v{i}" for i in range(MAX_NAMES)]
DIGITS = [str(d) for d in range(10)]
SYMBOLS = [":=", "=", "+", "-", ";", ".", "query", "start", "solve", "answer"]
WORDS = SYMBOLS + DIGITS + NAMES  # the task vocabulary (special tokens are added by tokenizer.py)

N_QUERY = 3
P_LITERAL = 0.2  # chance that the second operand of a step is a digit rather than a name


def _apply(a: int, op: str, b: int) -> int:
    return (a + b) % 10 if op == "+" else (a - b) % 10


def make_assignments(rng: random.Random, size: int, start: int = 0) -> list[tuple[str, str, str, str]]:
    """N assignments (target, operand1, op, operand2) in evaluation order; operands are names or digits.

    Step i assigns name ``v{(start + i) % 64}`` (names wrap around, so every name is common in
    training whatever the problem size).

    Step 0 adds two digits. Step k >= 1 takes one operand from the not-yet-used names (a random one;
    this keeps every name used once and the pool of unused names small, hence mostly recent) and
    the other, with probability 1 - P_LITERAL, uniformly from all earlier names (long, varied
    look-backs), else a digit. Operand order is random.
    """
    if not 2 <= size <= MAX_NAMES:
        raise ValueError(f"size must be in [2, {MAX_NAMES}], got {size}")
    names = [NAMES[(start + i) % MAX_NAMES] for i in range(size)]
    out = [(names[0], str(rng.randrange(10)), rng.choice("+-"), str(rng.randrange(10)))]
    unused = [0]
    for k in range(1, size):
        a = unused.pop(rng.randrange(len(unused)))
        others = [j for j in range(k) if j != a]
        if others and rng.random() >= P_LITERAL:
            b = rng.choice(others)
            if b in unused:
                unused.remove(b)
            second = names[b]
        else:
            second = str(rng.randrange(10))
        ops = [names[a], second]
        rng.shuffle(ops)
        out.append((names[k], ops[0], rng.choice("+-"), ops[1]))
        unused.append(k)
    return out


def evaluate(assignments) -> dict[str, int]:
    """Values of all names, by direct evaluation of the assignments (any order that resolves)."""
    env: dict[str, int] = {}
    pending = list(assignments)
    while pending:
        rest = []
        for target, x, op, y in pending:
            vals = [int(t) if t.isdigit() else env.get(t) for t in (x, y)]
            if None in vals:
                rest.append((target, x, op, y))
            else:
                env[target] = _apply(vals[0], op, vals[1])
        if len(rest) == len(pending):
            raise ValueError("assignments do not resolve")
        pending = rest
    return env


def make_problem(rng: random.Random, size: int) -> tuple[str, str, str]:
    """(prompt_text, solution_text, answer) for a problem with ``size`` steps.

    ``answer`` is the queried values as a space-separated digit string, e.g. "3 8 5".
    """
    start = rng.randrange(MAX_NAMES)
    steps = make_assignments(rng, size, start)
    env = evaluate(steps)
    half = (size + 1) // 2
    extra = rng.sample(range(half), min(N_QUERY - 1, half))
    query = [steps[-1][0]] + [steps[j][0] for j in extra]
    shuffled = list(steps)
    rng.shuffle(shuffled)
    prompt = " ; ".join(f"{t} := {x} {op} {y}" for t, x, op, y in shuffled)
    prompt += " ; query " + " ".join(query) + " ; start " + steps[0][0] + " solve"
    parts = []
    for t, x, op, y in steps:
        words = [t, ":=", x, op, y, ";"]
        for operand in (x, y):
            if not operand.isdigit():
                words += [operand, "=", str(env[operand]), ";"]
        vx, vy = (int(o) if o.isdigit() else env[o] for o in (x, y))
        words += [str(vx), op, str(vy), "=", str(env[t]), ";", t, "=", str(env[t]), "."]
        parts.append(" ".join(words))
    parts.append("answer " + " ; ".join(f"{q} = {env[q]}" for q in query))
    answer = " ".join(str(env[q]) for q in query)
    return prompt, " ".join(parts), answer


def parse_prompt(prompt_text: str) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """Inverse of the prompt format: (assignments in prompt order, query names)."""
    body, _, tail = prompt_text.partition(" ; query ")
    query = tail.split(" ; start ")[0].split()
    steps = []
    for stmt in body.split(" ; "):
        t, assign, x, op, y = stmt.split()
        assert assign == ":=" and op in "+-", stmt
        steps.append((t, x, op, y))
    return steps, query


def solve_prompt(prompt_text: str) -> str:
    """Reference answer computed from the prompt alone (independent of make_problem's bookkeeping)."""
    steps, query = parse_prompt(prompt_text)
    env = evaluate(steps)
    return " ".join(str(env[q]) for q in query)


_ANSWER_RE = re.compile(r"(v\d+)\s*=\s*(\d)")


def extract_answer(output_text: str) -> str | None:
    """The digits after the last ``answer`` marker (``name = d`` pairs), space-joined; None if absent."""
    idx = output_text.rfind("answer")
    if idx < 0:
        return None
    pairs = _ANSWER_RE.findall(output_text[idx + len("answer"):])
    if not pairs:
        return None
    return " ".join(d for _, d in pairs)


def check(output_text: str, answer: str) -> bool:
    """Exact match of all queried values."""
    return extract_answer(output_text) == answer


def count_tokens(text: str) -> int:
    return len(text.split())


ROLES = ("format", "copy", "fetch_near", "fetch_far", "arith", "answer")


def token_roles(solution_text: str, far: int = 20) -> list[str]:
    """Role of each solution word, for per-role accuracy: ``copy`` (formula operand/op copied from
    the prompt by name), ``fetch_near``/``fetch_far`` (a fetched value whose previous statement is
    < / >= ``far`` tokens back), ``arith`` (a step's result digit), ``answer`` (values in the
    answer line), ``format`` (everything else: deterministic or locally copied tokens)."""
    words = solution_text.split()
    roles = ["format"] * len(words)
    last: dict[str, int] = {}
    step_start = 0
    in_answer = False
    for i, w in enumerate(words):
        if w == "answer":
            in_answer = True
        if i > 0 and words[i - 1] == ".":
            step_start = i
        if not in_answer and i - step_start in (2, 3, 4):
            roles[i] = "copy"
        if i >= 2 and words[i - 1] == "=" and w.isdigit():
            name = words[i - 2]
            if in_answer:
                roles[i] = "answer"
            elif name.startswith("v") and name != words[step_start]:
                roles[i] = "fetch_far" if i - last.get(name, -(10**9)) >= far else "fetch_near"
            elif not name.startswith("v"):
                roles[i] = "arith"
            if name.startswith("v"):
                last[name] = i
    return roles


def lookback_distances(prompt_text: str, solution_text: str) -> list[int]:
    """For each value fetched in the solution (``name = d`` inside a step, not the step's own result),
    the distance in tokens back to that name's defining ``name = d`` (generated) — for analysis."""
    words = solution_text.split()
    defined: dict[str, int] = {}
    dists = []
    step_target = None
    for i, w in enumerate(words):
        if i + 2 < len(words) and words[i + 1] == ":=":
            step_target = w
        if w.startswith("v") and i + 2 < len(words) and words[i + 1] == "=" and words[i + 2].isdigit():
            if w == step_target and w not in defined:
                defined[w] = i + 2
            elif w in defined:
                dists.append(i + 1 - defined[w])
    return dists
