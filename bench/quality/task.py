"""Pointer-chain task: the reasoning proxy's training and evaluation data (pure Python).

A problem has N named values v_s, v_{s+1}, ... (names mod 64 from a random start s, each
assigned once). The prompt gives the first two values and, for every later step k, a pointer
digit δ_k, in **shuffled** order. Step k computes

    v_k = (v_{k-1} + v_p) mod 10,   p = k - 2 - 3·δ_k      (so p is 2..29 steps back)

so every step fetches one value generated far back (by name) and one generated just before. The
answer is three values: two from the first half and the last, fetched again by name at the end.

    prompt   : L45=0 P43=0 P44=0 P42=0 ; query QA40 QB41 QE45 ; seed V40=7 V41=2 .
    solution : K42 P42=0 r40 V40=7 ; r41 V41=2 ; 2 + 7 = 9 ; V42=9 .
               ...
               K45 L45=0 r43 V43=6 ; r44 V44=3 ; 3 + 6 = 9 ; V45=9
               answer r40 V40=7 and r41 V41=2 last r45 V45=9

(one line; breaks added here). ``Vk=d`` states v_k = d; ``Pk=δ`` is step k's pointer (``Lk=δ``
for the last step); ``Kk`` opens step k and asks for its pointer; ``rk`` asks for v_k's value;
``QAk``/``QBk``/``QEk`` are the queried names (QE = the last step).

Compound words make every lookup a *one-hop* associative recall (the asking word and the word
holding the answer share the name k, and the payload is in the same word), which a 2.4M-param
Llama learns in ~150 steps, where a two-layer induction circuit stayed near chance. Look-back
distances vary from 1 to 29 steps (16 words each), up to ~1,000 tokens for the answer, and the
prompt holds only two seed values, so a KV-cache policy that drops the wrong generated entries
breaks the chain. The stop decision is local: the last step recalls an ``Lk=δ`` pointer, so
``answer`` follows its closing ``Vk=d`` directly (no ``.``).

Size N = number of values (2 seeds + N-2 steps); the solution is 16 * (N - 2) + 8 words
(N=21 -> 312, N=62 -> 968).
"""

from __future__ import annotations

import random
import re

MAX_NAMES = 64
MAX_DELTA = 9  # pointer digit range 0..9 -> look-back 2..29 steps

SYMBOLS = [";", "+", "=", ".", "query", "seed", "answer", "and", "last"]
DIGITS = [str(d) for d in range(10)]
FAMILIES = ["K", "r", "QA", "QB", "QE"]  # plain name words: Kk, rk, QAk, QBk, QEk
COMPOUNDS = [
    "V",
    "P",
    "L",
]  # Vk=d (value), Pk=d (pointer), Lk=d (the last step's pointer)
# task vocabulary, in the proxy tokenizer's id order (it adds <pad> <bos> <eos> <unk>)
WORDS = (
    SYMBOLS
    + DIGITS
    + [f"{f}{k}" for f in FAMILIES for k in range(MAX_NAMES)]
    + [f"{c}{k}={d}" for c in COMPOUNDS for k in range(MAX_NAMES) for d in range(10)]
)


_WORD_RE = re.compile(r"^(K|r|QA|QB|QE|V|P|L)(\d+)(?:=(\d))?$")


def parse_word(word: str) -> tuple[str, int, int | None] | None:
    """("V", 12, 3) for "V12=3", ("r", 5, None) for "r5"; None for symbols and digits."""
    m = _WORD_RE.match(word)
    return (
        (m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))
        if m
        else None
    )


def make_chain(rng: random.Random, size: int) -> tuple[list[int], list[int]]:
    """(values, deltas) for ``size`` values; deltas[i] is step i's pointer (unused for i < 2)."""
    if not 3 <= size <= MAX_NAMES:
        raise ValueError(f"size must be in [3, {MAX_NAMES}], got {size}")
    values = [rng.randrange(10), rng.randrange(10)]
    deltas = [0, 0]
    for i in range(2, size):
        d = rng.randint(0, min(MAX_DELTA, (i - 2) // 3))
        deltas.append(d)
        values.append((values[i - 1] + values[i - 2 - 3 * d]) % 10)
    return values, deltas


def make_problem(rng: random.Random, size: int) -> tuple[str, str, str]:
    """(prompt_text, solution_text, answer) for a chain of ``size`` values.

    ``answer`` is the three queried values as a space-separated digit string, e.g. "7 2 5". The
    last step's pointer is ``Lk=δ`` (prompt and solution) and that step ends without its ``.``:
    ``answer`` follows its closing ``Vk=d``.
    """
    start = rng.randrange(MAX_NAMES)
    values, deltas = make_chain(rng, size)

    def name(i: int) -> int:
        return (start + i) % MAX_NAMES

    half = max(2, (size + 1) // 2)
    qa, qb = rng.sample(range(half), 2)

    def ptr_word(i: int) -> str:
        return f"{'L' if i == size - 1 else 'P'}{name(i)}={deltas[i]}"

    pointers = [ptr_word(i) for i in range(2, size)]
    rng.shuffle(pointers)
    prompt = (
        " ".join(pointers)
        + f" ; query QA{name(qa)} QB{name(qb)} QE{name(size - 1)}"
        + f" ; seed V{name(0)}={values[0]} V{name(1)}={values[1]} ."
    )
    steps = []
    for i in range(2, size):
        p = i - 2 - 3 * deltas[i]
        k, prev, ptr = name(i), name(i - 1), name(p)
        steps.append(
            f"K{k} {ptr_word(i)} r{ptr} V{ptr}={values[p]} ; r{prev} V{prev}={values[i - 1]} ; "
            f"{values[i - 1]} + {values[p]} = {values[i]} ; V{k}={values[i]} ."
        )
    steps[-1] = steps[-1][: -len(" .")]
    q = [(qa, "answer"), (qb, "and"), (size - 1, "last")]
    steps.append(" ".join(f"{w} r{name(i)} V{name(i)}={values[i]}" for i, w in q))
    answer = " ".join(str(values[i]) for i, _ in q)
    return prompt, " ".join(steps), answer


def extract_answer(output_text: str) -> str | None:
    """Digits of the three ``Vk=d`` words after the last ``answer`` marker, space-joined."""
    idx = output_text.rfind("answer")
    if idx < 0:
        return None
    digits = [m.group(1) for m in re.finditer(r"\bV\d+=(\d)\b", output_text[idx:])]
    return " ".join(digits[:3]) if len(digits) >= 3 else None


def check(output_text: str, answer: str) -> bool:
    """Exact match of all three queried values."""
    return extract_answer(output_text) == answer


def count_tokens(text: str) -> int:
    return len(text.split())


def token_roles(solution_text: str, far: int = 20) -> list[str]:
    """Role of each solution word, for per-role accuracy: ``pointer`` (``Pk=δ`` recalled from the
    prompt and the ``rp`` it implies), ``fetch_near``/``fetch_far`` (a recalled ``Vj=d`` whose
    previous statement is < / >= ``far`` words back), ``arith`` (a step's result digit),
    ``answer`` (values recalled in the answer line), ``decide`` (one "stop here?" decision per
    step, which a greedy run must get right every time: the word after each step's closing
    ``Vk=d``, ``.`` or ``answer``), ``format`` (the rest: fixed or local)."""
    words = solution_text.split()
    roles = ["format"] * len(words)
    last: dict[int, int] = {}
    in_answer = False
    for i, w in enumerate(words):
        prev = words[i - 1] if i else ""
        if w == "answer":
            in_answer = True
        parsed = parse_word(w)
        pprev = parse_word(prev)
        closes_step = bool(pprev) and pprev[0] == "V" and i >= 2 and words[i - 2] == ";"
        if closes_step:
            roles[i] = "decide"
        elif parsed and parsed[0] in ("P", "L") or (pprev and pprev[0] in ("P", "L")):
            roles[i] = "pointer"
        elif parsed and parsed[0] == "V" and pprev and pprev[0] == "r":
            if in_answer:
                roles[i] = "answer"
            else:
                dist = i - last.get(parsed[1], -(10**9))
                roles[i] = "fetch_far" if dist >= far else "fetch_near"
        elif w.isdigit() and prev == "=":
            roles[i] = "arith"
        if parsed and parsed[0] == "V":
            last[parsed[1]] = i
    return roles
