"""Unit tests for the reasoning-proxy task (bench/quality): generator, checker, tokenizer round trip."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "quality"))
import task  # noqa: E402


def _reevaluate(prompt: str) -> dict[str, int]:
    """Values from the prompt alone, written independently of task.py: repeated passes over the
    shuffled assignments until every name is bound."""
    body = prompt.split(" ; query ")[0]
    stmts = [s.split() for s in body.split(" ; ")]
    env: dict[str, int] = {}
    for _ in range(len(stmts)):
        for t, _, x, op, y in stmts:
            if t in env:
                continue
            a = int(x) if x.isdigit() else env.get(x)
            b = int(y) if y.isdigit() else env.get(y)
            if a is not None and b is not None:
                env[t] = (a + b) % 10 if op == "+" else (a - b) % 10
    assert len(env) == len(stmts), "prompt does not resolve"
    return env


@pytest.mark.parametrize("size", [2, 3, 7, 14, 30, 42, 64])
def test_answer_matches_independent_evaluation(size):
    rng = random.Random(1000 + size)
    for _ in range(20):
        prompt, solution, answer = task.make_problem(rng, size)
        env = _reevaluate(prompt)
        query = prompt.split(" ; query ")[1].split(" ; start ")[0].split()
        start = int(prompt.split(" ; start ")[1].split()[0][1:])
        assert prompt.endswith(" solve") and len(query) == min(3, 1 + (size + 1) // 2)
        assert query[0] == f"v{(start + size - 1) % 64}"
        assert answer == " ".join(str(env[q]) for q in query)
        assert task.check(solution, answer)
        assert task.solve_prompt(prompt) == answer
        # every "name = d" in the solution states that name's true value
        w = solution.split()
        for i in range(len(w) - 2):
            if w[i].startswith("v") and w[i + 1] == "=":
                assert int(w[i + 2]) == env[w[i]]


def test_structure_no_reassignment_all_names_used_and_values_only_generated():
    rng = random.Random(7)
    for size in (5, 20, 40):
        prompt, solution, _ = task.make_problem(rng, size)
        body = prompt.split(" ; query ")[0]
        stmts = [s.split() for s in body.split(" ; ")]
        targets = [s[0] for s in stmts]
        start = int(prompt.split(" ; start ")[1].split()[0][1:])
        order = [f"v{(start + i) % 64}" for i in range(size)]
        assert sorted(targets) == sorted(order)  # each name assigned exactly once
        used = {o for s in stmts for o in (s[2], s[4]) if not o.isdigit()}
        assert used == set(order[:-1])  # the last value depends on all names
        for s in stmts:  # operands were assigned earlier in evaluation order
            for o in (s[2], s[4]):
                assert o.isdigit() or order.index(o) < order.index(s[0])
        assert " = " not in prompt  # values appear only in generated text
        # the solution evaluates in successor order from the start name
        steps = [w for w, nxt in zip(solution.split(), solution.split()[1:]) if nxt == ":="]
        assert steps == order


def test_deterministic_from_seed():
    a = [task.make_problem(random.Random(3), 25) for _ in range(2)]
    assert a[0] == a[1]
    assert task.make_problem(random.Random(4), 25) != a[0]
    starts = {task.make_problem(random.Random(i), 3)[0].split(" ; start ")[1] for i in range(200)}
    assert len(starts) > 50  # random start names: every name is common in training


def test_solution_lengths_and_lookback_distances_in_range():
    rng = random.Random(11)
    lens = {14: [], 42: []}
    dists = []
    for size in lens:
        for _ in range(50):
            prompt, solution, _ = task.make_problem(rng, size)
            lens[size].append(task.count_tokens(solution))
            dists += task.lookback_distances(prompt, solution)
    assert 280 <= min(lens[14]) and max(lens[14]) <= 360
    assert 900 <= min(lens[42]) and max(lens[42]) <= 1050
    # fetches reach varied distances, many far beyond a 64-256-token window
    assert min(dists) < 20 and max(dists) > 600
    assert sum(d >= 128 for d in dists) / len(dists) > 0.2
    assert len(set(dists)) > 100


def test_checker():
    assert task.extract_answer("... v9 = 3 . answer v9 = 3 ; v1 = 0 ; v4 = 7") == "3 0 7"
    assert task.check("x . answer v9 = 3 ; v1 = 0 ; v4 = 7", "3 0 7")
    assert not task.check("x . answer v9 = 3 ; v1 = 0 ; v4 = 8", "3 0 7")
    assert not task.check("x . answer v9 = 3 ; v1 = 0", "3 0 7")  # truncated
    assert not task.check("v9 = 3 ; v1 = 0 ; v4 = 7", "3 0 7")  # no answer marker
    assert task.extract_answer("no marker") is None


def test_tokenizer_round_trip(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tokenizer import save_tokenizer

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == len(task.WORDS) + 4
    prompt, solution, answer = task.make_problem(random.Random(5), 20)
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert len(ids) == 1 + len(prompt.split())
    sol_ids = tok(solution, add_special_tokens=False)["input_ids"]
    assert tok.decode(sol_ids) == solution
    assert tok.decode(sol_ids + [tok.eos_token_id], skip_special_tokens=True) == solution
    chat = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok(chat, add_special_tokens=False)["input_ids"] == ids
    assert task.check(tok.decode(sol_ids), answer)
