"""Unit tests for the reasoning-proxy task (bench/quality): generator, checker, the proxy tokenizer's round trip."""

from __future__ import annotations

import random
import re

import pytest

from bench.quality import task

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration


def _reevaluate(prompt: str) -> tuple[dict[int, int], dict[str, int], list[int]]:
    """Values from the prompt alone, written independently of task.py.

    Returns (value by name, query name by family, names in evaluation order)."""
    seeds = re.findall(r"\bV(\d+)=(\d)\b", prompt)
    pointers = {int(k): int(d) for k, d in re.findall(r"\b[PL](\d+)=(\d)\b", prompt)}
    query = {f: int(k) for f, k in re.findall(r"\b(QA|QB|QE)(\d+)\b", prompt)}
    assert len(seeds) == 2 and int(seeds[1][0]) == (int(seeds[0][0]) + 1) % 64
    order = [int(seeds[0][0]), int(seeds[1][0])]
    values = {int(k): int(d) for k, d in seeds}
    while (order[-1] + 1) % 64 in pointers:
        k = (order[-1] + 1) % 64
        back = 2 + 3 * pointers[k]  # v_k = v_{k-1} + v_{k-2-3d}  (mod 10)
        assert back <= len(order), "pointer reaches before the seeds"
        values[k] = (values[order[-1]] + values[order[-back]]) % 10
        order.append(k)
    assert len(order) == len(pointers) + 2, "pointers must cover consecutive names"
    return values, query, order


def _lookback_distances(solution_text: str) -> list[int]:
    """For each value recalled inside a step, the distance in words back to the generated word
    that defined it (seeds, defined in the prompt, are skipped)."""
    words = solution_text.split()
    defined: dict[int, int] = {}
    dists = []
    for i, w in enumerate(words):
        if w == "answer":
            break
        parsed = task.parse_word(w)
        if not parsed or parsed[0] != "V":
            continue
        if words[i - 1] == ";":  # "; Vk=d ." closes step k: the definition
            defined[parsed[1]] = i
        elif parsed[1] in defined:
            dists.append(i - defined[parsed[1]])
    return dists


@pytest.mark.parametrize("size", [3, 4, 7, 21, 40, 62, 64])
def test_answer_matches_independent_evaluation(size):
    rng = random.Random(1000 + size)
    for _ in range(20):
        prompt, solution, answer = task.make_problem(rng, size)
        values, query, order = _reevaluate(prompt)
        assert len(order) == size and query["QE"] == order[-1]
        assert (
            query["QA"] in order[: max(2, (size + 1) // 2)]
            and query["QB"] != query["QA"]
        )
        assert answer == " ".join(str(values[query[f]]) for f in ("QA", "QB", "QE"))
        assert task.check(solution, answer)
        # every value word in the solution states that name's true value
        for k, d in re.findall(r"\bV(\d+)=(\d)\b", solution):
            assert values[int(k)] == int(d)


def test_structure_no_reassignment_values_generated_and_fetched_by_name():
    rng = random.Random(7)
    for size in (5, 20, 40, 64):
        prompt, solution, _ = task.make_problem(rng, size)
        _, _, order = _reevaluate(prompt)
        assert len(set(order)) == size  # each name assigned once, no reuse of a name
        assert (
            len(re.findall(r"\bV\d+=\d\b", prompt)) == 2
        )  # only the two seeds are in the prompt
        words = solution.split()
        defined = [
            w for i, w in enumerate(words) if w.startswith("V") and words[i - 1] == ";"
        ]
        assert [int(w[1:].split("=")[0]) for w in defined] == order[
            2:
        ]  # in order, once each
        # each recalled value is asked for by its name: "rk Vk=d"
        for i, w in enumerate(words):
            if w.startswith("V") and words[i - 1] != ";":
                assert words[i - 1] == "r" + w[1:].split("=")[0]
        # steps are fixed-format: 16 words each (the last without its "."), then the answer line
        assert len(words) == 16 * (size - 2) + 8 and words[-9] == "answer"
        assert words[-10].startswith(f"V{order[-1]}=") and words[-11] == ";"


def test_deterministic_from_seed():
    a = [task.make_problem(random.Random(3), 25) for _ in range(2)]
    assert a[0] == a[1]
    assert task.make_problem(random.Random(4), 25) != a[0]
    starts = {
        task.make_problem(random.Random(i), 3)[0].split(" seed ")[1] for i in range(200)
    }
    assert len(starts) > 50  # random start names: every name is common in training


def test_solution_lengths_and_lookback_distances_in_range():
    rng = random.Random(11)
    assert task.count_tokens(task.make_problem(rng, 21)[1]) == 312
    assert task.count_tokens(task.make_problem(rng, 62)[1]) == 968
    dists = []
    for _ in range(50):
        prompt, solution, _ = task.make_problem(rng, 50)
        dists += _lookback_distances(solution)
    # fetches reach varied distances, many far beyond a 64-256-token window
    assert min(dists) < 20 and max(dists) > 400
    assert sum(d >= 128 for d in dists) / len(dists) > 0.2
    # steps have a fixed length (16 words), so distances fall on a lattice; the far fetch spans
    # 2..29 steps back, so at least 10 distinct distances show up in 50 problems
    assert len(set(dists)) >= 10


def test_checker():
    text = "... V9=3 . answer r1 V1=0 and r4 V4=7 last r9 V9=3"
    assert task.extract_answer(text) == "0 7 3"
    assert task.check(text, "0 7 3")
    assert not task.check(text, "0 7 4")
    assert not task.check("x . answer r1 V1=0 and r4 V4=7", "0 7 3")  # truncated
    assert not task.check(
        "r1 V1=0 and r4 V4=7 last r9 V9=3", "0 7 3"
    )  # no answer marker
    assert task.extract_answer("no marker") is None


def test_tokenizer_round_trip():
    """The committed proxy's tokenizer: one token per task word, chat template included."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from bench.models.proxy import proxy_model_path

    tok = AutoTokenizer.from_pretrained(proxy_model_path())
    assert len(tok) == len(task.WORDS) + 4
    prompt, solution, answer = task.make_problem(random.Random(5), 20)
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert len(ids) == 1 + len(
        prompt.split()
    )  # every word (incl. "V12=3") is one token
    sol_ids = tok(solution, add_special_tokens=False)["input_ids"]
    assert len(sol_ids) == len(solution.split())
    assert tok.decode(sol_ids) == solution
    assert (
        tok.decode(sol_ids + [tok.eos_token_id], skip_special_tokens=True) == solution
    )
    chat = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok(chat, add_special_tokens=False)["input_ids"] == ids
    assert task.check(tok.decode(sol_ids), answer)


def test_decide_role_marks_every_continue_or_stop_word():
    """One 'decide' word per step, right after its closing value: '.' to go on, 'answer' to
    stop."""
    rng = random.Random(5)
    for size in (3, 10, 33):
        _, solution, _ = task.make_problem(rng, size)
        words, roles = solution.split(), task.token_roles(solution)
        decided = [i for i, r in enumerate(roles) if r == "decide"]
        assert len(decided) == size - 2
        assert [words[i] for i in decided] == ["."] * (size - 3) + ["answer"]
        assert all(
            task.parse_word(words[i - 1])[0] == "V" and words[i - 2] == ";"
            for i in decided
        )


def test_the_last_pointer_is_the_one_l_word():
    """The last step's pointer is an L word (prompt and solution), queried as QE, and 'answer'
    follows its closing value directly."""
    p, s, _ = task.make_problem(random.Random(9), 30)
    last = re.search(r"\bL(\d+)=(\d)\b", p)
    assert len(re.findall(r"\bL\d+=\d\b", p)) == 1
    assert f"QE{last.group(1)} " in p and f"K{last.group(1)} {last.group(0)} " in s
    assert (
        " . answer" not in s
        and f"V{last.group(1)}=" in s.split(" answer ")[0].split()[-1]
    )
