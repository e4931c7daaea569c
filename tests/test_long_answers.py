"""The long-answer workload: requests of several problems, split and graded per problem. Pure."""

import os
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest

from bench.quality.real_lm import threshold_mean_kv
from bench.reasoning import long_answers, workload
from bench.reasoning.long_answers import (
    band_ratio_at_equal_kv,
    final_budget,
    kara_replay,
    summarize,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _problems(n):
    return [
        {"id": i, "question": f"What is {i} + 1?", "gold": str(i + 1)} for i in range(n)
    ]


def test_group_is_a_seeded_partition():
    probs = _problems(25)
    reqs = workload.group(probs, 10, seed=3)
    assert [len(r) for r in reqs] == [10, 10, 5]
    assert sorted(p["id"] for r in reqs for p in r) == list(range(25))
    assert reqs == workload.group(probs, 10, seed=3)
    assert reqs != workload.group(probs, 10, seed=4)
    with pytest.raises(ValueError):
        workload.group(probs, 0)


def test_message_numbers_every_problem_in_order():
    msg = workload.message(_problems(3))
    assert "following 3 math problems" in msg
    assert "\\boxed{42}" in msg and "{{" not in msg
    at = [msg.index(f"Problem {i}:\nWhat is {i - 1} + 1?") for i in (1, 2, 3)]
    assert at == sorted(at)


ANSWER = """Problem 1:
Steps for one. The answer is \\boxed{1}.

**Problem 2:** We compute 1 + 1. So \\boxed{2}

### Problem 3:
Earlier we had \\boxed{7}; corrected: \\boxed{3}.
"""


def test_split_at_headings_and_grade_each_part():
    parts = workload.split(ANSWER, 3)
    assert parts[0].startswith("Problem 1") and "\\boxed{2}" not in parts[0]
    assert parts[1].startswith("**Problem 2") and "\\boxed{2}" in parts[1]
    graded = workload.grade_request(ANSWER, [Fraction(1), Fraction(2), Fraction(3)])
    assert graded == [
        (True, "1"),
        (True, "2"),
        (True, "3"),
    ]  # last box of a part counts
    wrong = workload.grade_request(ANSWER, [Fraction(1), Fraction(5), Fraction(7)])
    assert [c for c, _ in wrong] == [True, False, False]


def test_a_heading_number_assigns_its_part_wherever_it_stands():
    # out of order: the label decides, not the position
    text = "Problem 1: \\boxed{1}\nProblem 3: \\boxed{3}\nProblem 2: \\boxed{2}"
    parts = workload.split(text, 3)
    assert parts[1].startswith("Problem 2") and parts[2].startswith("Problem 3")
    assert "\\boxed{2}" not in parts[2]  # a part ends at the next heading of any number
    graded = workload.grade_request(text, [Fraction(1), Fraction(2), Fraction(3)])
    assert graded == [(True, "1"), (True, "2"), (True, "3")]
    # a solution written twice: the first part of that number with an answer counts
    text = "Problem 1: \\boxed{1}\nProblem 1: \\boxed{9}\nProblem 3: \\boxed{3}"
    assert workload.grade_request(text, [1, 2, 3]) == [
        (True, "1"),
        (False, None),
        (True, "3"),
    ]
    # a truncated answer: the later problems are unanswered
    cut = workload.grade_request("Problem 1: \\boxed{1}\nProblem 2: we", [1, 2, 3])
    assert cut == [(True, "1"), (False, None), (False, None)]


def test_a_repeated_heading_before_the_solution_keeps_the_solution():
    text = (
        "**Problem 1:**\nA restated question.\n\n**Problem 1:**\n6 + 4 = 10, so \\boxed{10}\n"
        "**Problem 2:**\n\\boxed{7}"
    )
    assert workload.grade_request(text, [Fraction(10), Fraction(7)]) == [
        (True, "10"),
        (True, "7"),
    ]


def test_a_renumbered_problem_counts_for_the_number_it_was_given():
    # the model solves problem 3 under a second "Problem 2" and goes on at 4: problem 2 keeps its
    # first answer, problem 3 has none; numbers outside 1..k and text before a heading count for
    # no problem
    text = (
        "Intro \\boxed{5}\nProblem 1: \\boxed{1}\nProblem 2: \\boxed{2}\n"
        "Problem 2: \\boxed{3}\nProblem 4: \\boxed{4}\nProblem 11: \\boxed{11}"
    )
    got = workload.grade_request(text, [Fraction(i) for i in (1, 2, 3, 4)])
    assert got == [(True, "1"), (True, "2"), (False, None), (True, "4")]


def test_a_problem_whose_parts_hold_no_answer_has_none():
    text = "Problem 1: thinking\nProblem 1: still thinking\nProblem 2: \\boxed{2}"
    assert workload.split(text, 2)[0] == "Problem 1: thinking\n"
    assert workload.grade_request(text, [1, 2]) == [(False, None), (True, "2")]


def test_a_part_restating_a_question_belongs_to_it_whatever_its_heading():
    # the model lost its place: problem 3 solved under a second "Problem 2" heading, then
    # problem 2 restated under "Problem 3"; a part restating nothing goes by its heading
    questions = [
        "Tom has 3 red apples and buys 4 more. How many apples does Tom have?",
        "A train travels 60 miles per hour for 2 hours. How far does it go?",
        "Sara bakes 12 cookies and gives half to her brother. How many are left?",
    ]
    text = "".join(
        f"Problem {i}:\n{questions[q]} Working: \\boxed{{{a}}}\n"
        for i, q, a in ((1, 0, 7), (2, 2, 6), (3, 1, 120))
    )
    golds = [Fraction(7), Fraction(120), Fraction(6)]
    by_heading = workload.grade_request(text, golds)
    assert by_heading == [(True, "7"), (False, "6"), (False, "120")]
    assert workload.grade_request(text, golds, questions) == [
        (True, "7"),
        (True, "120"),
        (True, "6"),
    ]
    # no restatement: the heading decides, as without the questions
    bare = "Problem 1: \\boxed{7}\nProblem 2: \\boxed{120}\nProblem 3: \\boxed{6}"
    assert workload.grade_request(bare, golds, questions) == [
        (True, "7"),
        (True, "120"),
        (True, "6"),
    ]
    # a heading numbered past k that restates a question belongs to that question
    renumbered = text.replace("Problem 2:", "Problem 11:").replace(
        "Problem 3:", "Problem 12:"
    )
    assert [c for c, _ in workload.grade_request(renumbered, golds, questions)] == [
        True,
        True,
        True,
    ]


def test_questions_too_alike_to_tell_apart_leave_the_heading_to_decide():
    links = [
        "Let A be your answer to Problem 1 and B your answer to Problem 2. What is A + B?",
        "Let A be your answer to Problem 3 and B your answer to Problem 2. What is A + B?",
    ]
    part = (
        "Problem 2:\nLet A be your answer to Problem 1 and B your answer to Problem 2."
    )
    assert workload.restated(part, links) is None
    assert workload.restated("Problem 1:\n" + links[1], ["x y z", links[1]]) == 1
    assert workload.restated("Problem 1: no words of either", links) is None
    assert workload.restated(part, links[:1]) is None  # one question: nothing to tell


def test_regrade_reads_the_questions_from_the_workload_file(tmp_path):
    import gzip
    import json

    questions = [
        "Tom has 3 red apples and buys 4 more. How many apples does Tom have?",
        "Sara bakes 12 cookies and gives half to her brother. How many are left?",
    ]
    reqs = [
        [
            {"id": i, "question": q, "gold": g}
            for i, (q, g) in enumerate(zip(questions, ("7", "6")))
        ]
    ]
    with gzip.open(tmp_path / "workload-independent.json.gz", "wt") as f:
        json.dump(reqs, f)
    assert long_answers.asked_requests(str(tmp_path)) == {(0, 1): questions}
    # a run checked against this one shares its workload by a pointer, a changed one keeps a copy
    later, other = tmp_path / "later", tmp_path / "other"
    later.mkdir(), other.mkdir()
    long_answers.write_workload(str(later), "independent", reqs, str(tmp_path))
    assert sorted(os.listdir(later)) == ["workload-independent.same-as"]
    assert long_answers.asked_requests(str(later)) == {(0, 1): questions}
    changed = [reqs[0][::-1]]
    long_answers.write_workload(str(other), "independent", changed, str(later))
    assert sorted(os.listdir(other)) == ["workload-independent.json.gz"]
    assert long_answers.asked_requests(str(other)) == {(1, 0): questions[::-1]}
    text = (
        f"Problem 1:\n{questions[1]} Half: \\boxed{{6}}\n"
        f"Problem 2:\n{questions[0]} Sum: \\boxed{{7}}\n"
    )
    assert long_answers.grade_items(text, reqs[0])["correct"] == [True, True]
    no_questions = [{k: v for k, v in p.items() if k != "question"} for p in reqs[0]]
    assert long_answers.grade_items(text, no_questions)["correct"] == [False, False]


@pytest.mark.parametrize(
    "boxed, value",
    [
        ("64 - 2 \\times 24 = 64 - 48 = 16", 16),
        ("x = 5", 5),
        ("16 \\text{ dollars} = \\$16", 16),
        ("\\frac{3}{4} \\times 8 = 6", 6),
        ("64 - 48", None),  # an expression left unevaluated is no answer
        ("3 \\times 4 =", None),
    ],
)
def test_boxed_working_is_read_after_its_last_equals_sign(boxed, value):
    from bench.reasoning.grading import grade, to_number

    assert to_number(boxed) == value
    text = f"so \\boxed{{{boxed}}}."
    assert grade(text, Fraction(16))[0] == (value == 16)


def test_without_headings_boxes_are_read_in_order_only_when_counts_match():
    assert workload.grade_request(
        "a \\boxed{1} b \\boxed{2}", [Fraction(1), Fraction(2)]
    ) == [
        (True, "1"),
        (True, "2"),
    ]
    assert workload.split("only \\boxed{1}", 2) == [None, None]


def test_final_budget_centres_the_sawtooth_on_the_final_kv():
    gap, floor = 224, 40
    n = final_budget(600, gap, floor)
    assert n + 1 <= 600 <= n + gap + 1 and abs((n + 1 + n + gap + 1) / 2 - 600) <= 1
    assert final_budget(100, gap, floor) == floor
    # over a long answer the threshold's KV averages near its sawtooth's middle
    assert abs(threshold_mean_kv(n, gap, 20000) - 600) < 20


def _result(config, rows, ratio=0.2):
    return {"config": config, "name": config, "ratio": ratio, "requests": rows}


def _row(i, correct, g, final, mean):
    return {
        "request": i,
        "problems": [10 * i + j for j in range(len(correct))],
        "correct": correct,
        "answers": ["1" if c else None for c in correct],
        "completion_tokens": g,
        "finish": "stop",
        "kv_final": final,
        "kv_mean": mean,
    }


def test_summary_pairs_per_problem_and_reports_retention():
    full = _result("full", [_row(0, [True, True, False], 1001, 1000, 499.5)], None)
    kara = _result("kara", [_row(0, [True, False, True], 1001, 300, 349.65)])
    row = summarize(kara, full, None, early=1)
    assert (row["n"], row["correct"], row["won"], row["lost"]) == (3, 2, 1, 1)
    assert row["ret_final"] == pytest.approx(0.3) and row["ret_mean"] == pytest.approx(
        0.7
    )
    assert row["vs_full_final"] == pytest.approx(0.3)
    assert (row["acc_first"], row["acc_later"]) == (1.0, 0.5)
    assert (row["lost_first"], row["lost_later"]) == (0, 1)  # problem 2 of its request
    assert row["no_answer"] == 1
    other = _result("random", [_row(0, [False, False, True], 1001, 300, 349.65)])
    assert summarize(other, full, kara, early=1)["kara_lost"] == 1
    # retention with the prompt counted on both sides: unknown without the prompt's length
    assert row["total_ret_final"] is None and row["total_ret_mean"] is None
    kara["requests"][0]["prompt_tokens"] = 500
    row = summarize(kara, full, None, early=1)
    assert row["total_ret_final"] == pytest.approx((500 + 300) / (500 + 1000))
    assert row["total_ret_mean"] == pytest.approx((500 + 349.65) / (500 + 499.5))
    assert row["total_ret_final"] > row["ret_final"]  # the prompt is never compressed


def test_the_table_takes_prompt_lengths_from_the_run_records(tmp_path):
    import json

    _write_full(
        tmp_path, None, problems=[5], golds=["3"], correct=[True], answers=["3"]
    )
    args = SimpleNamespace(out=str(tmp_path), early=1, model="tiny", dtype="float32")
    (row,) = long_answers.report(args)
    assert row["total_ret_final"] is None  # no run record: no prompt length, no figure
    assert "| - / - |" in (tmp_path / "long_answers.md").read_text()
    record = {
        "command": "python -m bench.reasoning.long_answers",
        "date": "2026-11-28T00:00:00+00:00",
        "machine": {"text": "test"},
        "notes": {"prompt_tokens": [60]},
    }
    (tmp_path / "run.json").write_text(json.dumps(record))
    (row,) = long_answers.report(args)
    assert row["prompt_tokens"] == 60
    assert row["total_ret_final"] == pytest.approx(1.0)  # full KV keeps every row
    assert "| 1.00 / 1.00 |" in (tmp_path / "long_answers.md").read_text()
    record["notes"]["prompt_tokens"] = [61]
    (tmp_path / "run-2.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="other prompt lengths"):
        long_answers.report(args)


def test_kara_replay_schedule():
    # shorter than a window: nothing is cut; the runtime's full-KV figures (g - 1, (g - 2) / 2)
    assert kara_replay(200, 256, 32, 32, 45) == (199, 99.0)
    final, mean = kara_replay(2000, 256, 32, 32, 45)
    events, rest = divmod(2000 - 1 - final, 224 - 45)  # each event cuts W - U rows to K
    assert rest == 0
    # what stays uncompressed after the last event: between the buffer and a window + a period
    assert 32 <= final - 45 * events <= 256 + 32
    assert final / 1999 < 0.35 and mean < 999
    # a recency band holds more, a lower r less
    assert kara_replay(2000, 256, 32, 32, 45, recent=128)[1] > mean
    assert kara_replay(2000, 256, 32, 32, 20)[1] < mean


def test_band_ratio_matches_kara_mean_kv():
    args = SimpleNamespace(window=256, buffer=32, period=32, recent=0)
    rows = [
        {"completion_tokens": g, "kv_mean": kara_replay(g, 256, 32, 32, 45)[1]}
        for g in (1400, 2100)
    ]
    assert band_ratio_at_equal_kv(rows, args) == 45 / 224
    args.recent = 128  # the band costs KV: its older windows must keep fewer
    assert band_ratio_at_equal_kv(rows, args) < 45 / 224


# ------------------------------------------------------------------ the chained workload


def _pool(n):
    return [{"id": i, "question": f"Q{i}?", "gold": str(3 * i + 1)} for i in range(n)]


def test_chained_requests_link_earlier_answers_with_exact_golds():
    reqs = workload.chain(_pool(20), seed=1)
    assert len(reqs) == 2  # 8 base problems per request, the rest dropped
    spec = workload.CHAIN
    for items in reqs:
        assert len(items) == spec["size"]
        bases = [p for p in items if p["kind"] == "base"]
        assert len(bases) == workload.base_count() == 8
        for pos, p in enumerate(items, 1):
            if p["kind"] != "link":
                continue
            assert tuple(p["refs"]) == spec["links"][pos]
            values = [Fraction(items[r - 1]["gold"]) for r in p["refs"]]
            assert Fraction(p["gold"]) == sum(
                c * v for c, v in zip(p["coefficients"], values)
            )
            for r in p["refs"]:
                assert f"answer to Problem {r}" in p["question"]
    # the last link combines links only, so the final value depends on the whole chain
    last = reqs[0][-1]
    assert last["kind"] == "link" and all(
        reqs[0][r - 1]["kind"] == "link" for r in last["refs"]
    )
    assert reqs == workload.chain(_pool(20), seed=1)
    assert reqs != workload.chain(_pool(20), seed=2)
    msg = workload.message(reqs[0])
    assert "use the value you put in \\boxed{}" in msg
    assert "Problem 12:\nLet A be your answer to Problem 5" in msg
    assert "use the value" not in workload.message(_pool(3))


def test_link_expression_reads_as_written():
    assert workload.expression((1, 2, -1)) == "A + 2 × B - C"
    assert workload.expression((3, -1)) == "3 × A - B"
    assert workload.link_question((3, 6), (1, 1)) == (
        "Let A be your answer to Problem 3 and B be your answer to Problem 6. What is A + B?"
    )


def test_links_are_graded_right_and_consistent():
    items = [
        {"id": "0.1", "kind": "base", "gold": "10"},
        {"id": "0.2", "kind": "base", "gold": "4"},
        {
            "id": "0.3",
            "kind": "link",
            "refs": [1, 2],
            "coefficients": [1, 2],
            "gold": "18",
        },
    ]
    # problem 2 wrong (5), the link computed from it: wrong but consistent
    text = "Problem 1: \\boxed{10}\nProblem 2: \\boxed{5}\nProblem 3: A=10, B=5: \\boxed{20}"
    got = long_answers.grade_items(text, items)
    assert got["correct"] == [True, False, False]
    assert got["consistent"] == [None, None, True]
    # a link whose look-up failed: inconsistent; a missing earlier answer: inconsistent
    text = "Problem 1: \\boxed{10}\nProblem 2: \\boxed{4}\nProblem 3: \\boxed{14}"
    assert long_answers.grade_items(text, items)["consistent"] == [None, None, False]
    text = "Problem 1: \\boxed{10}\nProblem 3: \\boxed{18}"
    got = long_answers.grade_items(text, items)
    assert got["correct"] == [True, False, True] and got["consistent"][2] is False


# ------------------------------------------------------------------ template instances

TEMPLATE = {
    "id_orig": 1,
    "id_shuffled": 7,
    "question": "Ann has 3 bags of 4 apples and eats 2. How many apples are left?",
    "answer": "3 * 4 = 12, 12 - 2 = 10\n#### 10",
    "question_annotated": (
        "{name,Ann} has {b,3} bags of {a,4} {fruit,apple}s and eats {e,2}. How many "
        "{fruit,apple}s are left?\n\n#init:\n- name = sample(names)\n"
        "- fruit = sample(fruits)\n- $b = range(2, 9)\n- $a = range(3, 13)\n"
        "- $e = range(1, 6)\n\n#conditions:\n- e < a * b\n- divides(a * b, 2)\n\n"
        "#answer: b * a - e\n"
    ),
    "answer_annotated": "{b} * {a} = {b*a}\n#### {b*a-e}",
}
WORDS = {"names": ["Bo", "Cy", "Di"], "fruits": ["pear", "plum"]}


def test_template_instances_have_exact_golds_and_new_numbers():
    from bench.reasoning import symbolic

    insts = symbolic.instances([TEMPLATE] * 1, WORDS, 1, seed=3)
    (inst,) = insts
    import re

    m = re.fullmatch(
        r"(\w+) has (\d+) bags of (\d+) (\w+)s and eats (\d+)\. How many (\w+)s are left\?",
        inst["question"],
    )
    assert m, inst["question"]
    name, b, a, fruit, e, fruit2 = m.groups()
    b, a, e = int(b), int(a), int(e)
    assert name in WORDS["names"] and fruit == fruit2 and fruit in WORDS["fruits"]
    assert 2 <= b < 9 and 3 <= a < 13 and 1 <= e < 6 and (a * b) % 2 == 0
    assert Fraction(inst["gold"]) == b * a - e
    assert inst["question"] != TEMPLATE["question"] and inst["id"] == 100
    assert symbolic.instances([TEMPLATE], WORDS, 1, seed=3) == insts


def test_a_template_contradicting_its_own_gold_is_not_used():
    from bench.reasoning import symbolic

    wrong = dict(TEMPLATE, answer="#### 11")  # the defaults give 10
    assert symbolic.templates([wrong], WORDS) == []
    with pytest.raises(ValueError, match="only 0 template instances"):
        symbolic.instances([wrong], WORDS, 1, seed=0)


def test_template_numbers_are_exact():
    from bench.reasoning import symbolic

    env = symbolic.helpers(__import__("random").Random(0))
    assert symbolic.evaluate(symbolic.parse("7 / 2 + 0.25"), env) == Fraction(15, 4)
    assert symbolic.evaluate(symbolic.parse("int(7 / 2)"), env) == 3
    assert symbolic.display(Fraction(5, 2)) == "2.5"
    assert symbolic.display(Fraction(1, 3)) == "1/3"
    with pytest.raises(symbolic.Unreadable):
        symbolic.evaluate(symbolic.parse("open('x')"), env)


# ------------------------------------------------------------------ regrading


def _write_full(
    tmp_path, text: str | None = None, suffix: str = ".json.gz", **fields
) -> None:
    """OUT/full.json.gz (or ``suffix``: older runs stored plain .json) with one request of
    ``fields`` (and OUT/full.answers.jsonl.gz holding ``text``), the rest of the record as the
    harness writes it."""
    import gzip
    import json

    row = {
        "request": 0,
        "completion_tokens": 40,
        "finish": "stop",
        "kv_final": 39,
        "kv_peak": 39,
        "kv_mean": 19.0,
        **fields,
    }
    result = {"config": "full", "name": "full", "ratio": None, "requests": [row]}
    long_answers.write_result(str(tmp_path / ("full" + suffix)), result)
    if text is not None:
        with gzip.open(tmp_path / "full.answers.jsonl.gz", "wt") as f:
            f.write(json.dumps({"request": 0, "text": text}) + "\n")


def test_a_compressed_result_holds_the_plain_files_bytes_and_is_found_by_name(tmp_path):
    """OUT/<name>.json.gz is the plain result file's text compressed (same bytes each write);
    results are listed by name whichever form they take, the workload, run records and
    tables are not results, and one configuration with both forms is refused."""
    import gzip

    from bench.reasoning import gsm8k

    result = {"config": "kara", "name": "kara_r0.2", "requests": [{"request": 0}]}
    long_answers.write_result(str(tmp_path / "kara_r0.2.json.gz"), result)
    first = (tmp_path / "kara_r0.2.json.gz").read_bytes()
    long_answers.write_result(str(tmp_path / "kara_r0.2.json.gz"), result)
    assert (tmp_path / "kara_r0.2.json.gz").read_bytes() == first
    long_answers.write_result(str(tmp_path / "plain.json"), result)
    assert gzip.decompress(first) == (tmp_path / "plain.json").read_bytes()
    (tmp_path / "plain.json").rename(tmp_path / "full.json")
    for other in ("workload-chained.json.gz", "run.json", "long_answers.md"):
        (tmp_path / other).write_text("{}")
    names = gsm8k.result_names(str(tmp_path), long_answers.NOT_RESULTS)
    assert names == ["full", "kara_r0.2"]
    assert gsm8k.load_result(str(tmp_path), "kara_r0.2") == result
    assert gsm8k.load_result(str(tmp_path), "snapkv_r0.2") is None
    long_answers.write_result(str(tmp_path / "full.json.gz"), result)
    with pytest.raises(ValueError, match="two result files"):
        gsm8k.load_result(str(tmp_path), "full")


@pytest.mark.parametrize("suffix", [".json.gz", ".json"])
def test_regrade_reports_old_and_new_per_configuration(tmp_path, suffix):
    from bench.reasoning import gsm8k

    text = "Problem 1: \\boxed{64 - 2 \\times 24 = 64 - 48 = 16}\nProblem 2: \\boxed{3}"
    _write_full(
        tmp_path,
        text,
        suffix,
        problems=[5, 6],
        golds=["16", "3"],
        correct=[False, True],
        answers=[None, "3"],
    )
    (rec,) = long_answers.regrade(str(tmp_path))
    assert (rec["old"], rec["new"], rec["gained"], rec["lost"]) == (1, 2, 1, 0)
    assert [p.name for p in tmp_path.glob("full.json*")] == ["full" + suffix]
    saved = gsm8k.load_result(str(tmp_path), "full")
    assert saved["requests"][0]["correct"] == [True, True]
    assert saved["grader"] == long_answers.grader_digest()
    md = (tmp_path / "regrade.md").read_text()
    assert "| full | 2 | 1 | 2 | +1 / -0 |" in md
    # the table marks nothing once regraded, and marks a result graded by other code
    args = SimpleNamespace(out=str(tmp_path), early=1, model="tiny", dtype="float32")
    long_answers.report(args)
    assert "graded by another grader" not in (tmp_path / "long_answers.md").read_text()
    saved["grader"] = "0" * 12
    long_answers.write_result(str(tmp_path / ("full" + suffix)), saved)
    long_answers.report(args)
    assert "graded by another grader" in (tmp_path / "long_answers.md").read_text()


def test_a_resumed_run_with_every_configuration_done_runs_nothing_and_records_nothing(
    tmp_path, monkeypatch
):
    """A run resumed with every configuration done: no engine, no run record (a record says
    something ran); one configuration left: it runs, under a record."""
    import json

    from bench.reasoning import gsm8k

    _write_full(tmp_path, problems=[5], golds=["16"], correct=[True], answers=["16"])
    monkeypatch.setattr(gsm8k, "model_path", lambda model: "unused")
    monkeypatch.setattr(
        long_answers, "build_requests", lambda args: [[_problems(1)[0]]]
    )
    monkeypatch.setattr(long_answers, "chat_prompts", lambda reqs, path: [[1, 2, 3]])
    ran = []
    monkeypatch.setattr(
        long_answers, "run_config", lambda config, *a, **k: ran.append(config)
    )
    monkeypatch.setattr(long_answers, "finalize", lambda *a, **k: None)
    argv = ["--out", str(tmp_path), "--configs", "full", "--model", "tiny"]
    long_answers.main(argv)
    assert ran == [] and not list(tmp_path.glob("run*.json"))
    long_answers.main([*argv[:3], "full", "kara", *argv[4:]])
    assert ran == ["kara"] and [p.name for p in tmp_path.glob("run*.json")] == [
        "run.json"
    ]
    assert json.loads((tmp_path / "run.json").read_text())["notes"]["requests"] == 1


def _no_engine(monkeypatch):
    """The harness's main with no model and no engine: ([(engine options, lanes)], [(config,
    r, options finalized)]) as it would run them."""
    from bench.reasoning import gsm8k

    monkeypatch.setattr(gsm8k, "model_path", lambda model: "unused")
    monkeypatch.setattr(long_answers, "build_requests", lambda args: [_problems(2)])
    monkeypatch.setattr(long_answers, "chat_prompts", lambda reqs, path: [[1, 2, 3]])
    monkeypatch.setattr(long_answers, "report", lambda args: [])
    engines, finalized = [], []
    monkeypatch.setattr(
        long_answers, "run_lanes", lambda ln, opts, *a, **k: engines.append((opts, ln))
    )
    monkeypatch.setattr(
        long_answers,
        "finalize",
        lambda config, requests, args, opts: finalized.append(
            (config, args.ratio, opts)
        ),
    )
    return engines, finalized


def test_a_sweep_runs_every_ratio_of_a_configuration_in_one_engine(
    tmp_path, monkeypatch
):
    """--ratios: one engine per configuration, one lane per r (its requests pinned at that r per
    request), each finalized under its own name; an r already done is not run again."""
    engines, finalized = _no_engine(monkeypatch)
    argv = ["--out", str(tmp_path), "--model", "tiny", "--configs", "kara", "snapkv"]
    long_answers.main([*argv, "--ratios", "0.3", "0.5"])
    assert len(engines) == 2  # one engine per configuration
    opts, lanes = engines[0]
    assert opts["kara_policy"] == "kara"
    assert [ln.name for ln in lanes] == ["kara_r0.3", "kara_r0.5"]
    assert [ln.per_request for ln in lanes] == [
        [{"retention": 0.3}],
        [{"retention": 0.5}],
    ]
    snap = engines[1][1]
    assert [ln.per_request[0]["match_kara"]["retention"] for ln in snap] == [0.3, 0.5]
    assert [(c, r, o.get("kara_retention")) for c, r, o in finalized][:2] == [
        ("kara", 0.3, 0.3),
        ("kara", 0.5, 0.5),
    ]
    # r 0.3 done: only r 0.5 runs again
    done = {"config": "kara", "name": "kara_r0.3", "requests": []}
    long_answers.write_result(str(tmp_path / "kara_r0.3.json.gz"), done)
    engines.clear()
    long_answers.main([*argv[:-1], "--ratios", "0.3", "0.5"])
    assert [ln.name for ln in engines[0][1]] == ["kara_r0.5"]


def test_together_answers_kara_and_its_variants_in_one_engine(tmp_path, monkeypatch):
    """--together: one engine serving kara_together, a lane per configuration whose requests name
    their variant by a retention tag; each finalized under its own name and options; anything
    that cannot share Kara's engine is refused before the model is read."""
    from support import policy_registry_restored

    from bench.reasoning import configs

    monkeypatch.setenv(configs.POLICY_FILES, "")
    engines, finalized = _no_engine(monkeypatch)
    files = [
        x
        for f in ("kara_redundancy.py", "kara_global.py", "kara_structure.py")
        for x in ("--policy-file", os.path.join(ROOT, "bench", "policies", f))
    ]
    argv = ["--out", str(tmp_path), "--model", "tiny", "--together", *files]
    with policy_registry_restored():
        long_answers.main(
            [*argv, "--configs", "kara", "kara_redundancy", "kara_global"]
        )
        ((opts, lanes),) = engines
        assert opts["kara_policy"] == "kara_together"
        assert opts["kara_together_variants"] == "kara_redundancy,kara_global"
        assert opts["kara_together_retention"] == 0.2
        assert [ln.name for ln in lanes] == [
            "kara_r0.2",
            "kara_redundancy_r0.2",
            "kara_global_r0.2",
        ]
        tags = [ln.per_request[0]["retention"] for ln in lanes]
        assert tags == [0.2, 0.2001, 0.2002]
        assert [(c, o["kara_policy"]) for c, _, o in finalized] == [
            ("kara", "kara"),
            ("kara_redundancy", "kara_redundancy"),
            ("kara_global", "kara_global"),
        ]
        assert all(o["together"] == opts for *_, o in finalized)
        engines.clear()
        for bad in (["full", "kara_global"], ["kara"], ["kara_structure"]):
            with pytest.raises(SystemExit):
                long_answers.main([*argv, "--configs", *bad])
        with pytest.raises(SystemExit):
            long_answers.main([*argv, "--ratios", "0.3", "--configs", "kara_global"])
        assert not engines


def test_together_answers_threshold_baselines_in_one_engine(tmp_path, monkeypatch):
    """--together with threshold baselines: one threshold_together engine, each baseline's
    requests matched to Kara at r with a retention tag naming it; --check-ratio checks the first
    baseline at another r against an engine of its own."""
    import gzip
    import json

    from support import policy_registry_restored

    from bench.reasoning import configs

    monkeypatch.setenv(configs.POLICY_FILES, "")
    # imported afresh, so that it registers in the registry restored below
    monkeypatch.delitem(sys.modules, "kara_bench_policy_kara_together", raising=False)
    engines, finalized = _no_engine(monkeypatch)
    ref = tmp_path / "alone"
    ref.mkdir()
    long_answers.write_result(
        str(ref / "rkv_r0.2.json.gz"), {"requests": [{"problems": [0, 1]}]}
    )
    with gzip.open(ref / "rkv_r0.2.answers.jsonl.gz", "wt") as f:
        f.write(json.dumps({"request": 0, "text": "x"}) + "\n")
    argv = ["--out", str(tmp_path / "out"), "--model", "tiny", "--together"]
    with policy_registry_restored():
        long_answers.main(
            [*argv, "--ratio", "0.4", "--configs", "rkv", "snapkv"]
            + [
                "--check-from",
                str(ref),
                "--check-ratio",
                "0.2",
                "--check-requests",
                "1",
            ]
        )
        ((opts, lanes),) = engines
        assert opts["kara_policy"] == "threshold_together"
        assert opts["kara_threshold_together_variants"] == "rkv,snapkv"
        assert opts["kara_threshold_together_window"] == 32  # min(default, U)
        assert [ln.name for ln in lanes] == [
            "rkv_r0.4",
            "snapkv_r0.4",
            "check-rkv_r0.2",
        ]
        specs = [ln.per_request[0]["match_kara"] for ln in lanes]
        assert [s["retention"] for s in specs] == [0.4, 0.4001, 0.2]
        assert all(
            s
            == dict(
                window=256, buffer=32, period=32, recent=0, retention=s["retention"]
            )
            for s in specs
        )
        assert [(c, r, o["kara_policy"]) for c, r, o in finalized] == [
            ("rkv", 0.4, "rkv"),
            ("snapkv", 0.4, "snapkv"),
        ]
        assert all(o["together"] == opts for *_, o in finalized)
        engines.clear()
        # a baseline beside kara, a tag that changes K, a check ratio without a check
        for bad in (
            ["--configs", "kara", "rkv"],
            [
                "--ratio",
                "0.2005",  # no room for tags below 0.001
                "--configs",
                "rkv",
                "snapkv",
            ],
            ["--check-ratio", "0.2", "--configs", "rkv", "snapkv"],
        ):
            with pytest.raises(SystemExit):
                long_answers.main([*argv, *bad])
        assert not engines


def test_a_sweep_refuses_what_has_no_per_request_ratio(tmp_path):
    args = long_answers.parser().parse_args(["--out", str(tmp_path)])
    args.n_requests = 1
    for config in ("full", "kara-band", "snapkv-mean"):
        with pytest.raises(SystemExit, match=config):
            long_answers.pinned_options(config, args)
    with pytest.raises(SystemExit):
        long_answers.main(["--out", str(tmp_path), "--ratios", "0", "0.5"])
    with pytest.raises(SystemExit):
        long_answers.main(["--out", str(tmp_path), "--check-from", str(tmp_path)])


def test_the_batching_check_compares_answers_with_the_engine_of_their_own(tmp_path):
    import gzip
    import json

    ref, out = tmp_path / "alone", tmp_path / "shared"
    ref.mkdir()
    out.mkdir()
    with gzip.open(ref / "kara_r0.2.answers.jsonl.gz", "wt") as f:
        for i, text in enumerate(["one", "two", "three"]):
            f.write(json.dumps({"request": i, "text": text}) + "\n")
    with open(out / "check-kara_r0.2.partial.jsonl", "w") as f:
        for i, text in enumerate(["one", "TWO"]):
            f.write(json.dumps({"request": i, "text": text}) + "\n")
    check = long_answers.batching_check(str(out), str(ref), "kara_r0.2")
    assert (check["same_text"], check["differ"]) == ([0], [1])
    stored = json.loads((out / "batching-check.json").read_text())
    assert stored["kara_r0.2"]["requests"] == [0, 1]


# ------------------------------------------------------------------ configurations


def test_every_registered_policy_is_a_configuration(monkeypatch):
    """A policy registered after the harness was written is a configuration; a budget-taking one
    is matched to Kara's trajectory; each configuration's options are what sgl_kara resolves."""
    from dataclasses import dataclass, field

    from bench.reasoning import configs
    from sgl_kara.config import KaraConfig
    from sgl_kara.policies import base
    from sgl_kara.policies.threshold import ThresholdOptions, ThresholdPolicy

    @dataclass(frozen=True)
    class Opts(ThresholdOptions):
        stride: int = field(default=2, metadata={"help": "keep every stride-th entry"})

    class Strided(ThresholdPolicy):
        name = "strided-test"
        prefix = "strided_test_"
        Options = Opts
        needs_queries = False

        def score(self, inp):
            raise NotImplementedError

    monkeypatch.setitem(base._REGISTRY, Strided.name, Strided)
    assert "strided-test" in configs.budget_policies()
    assert "strided-test" in long_answers.default_configs()
    kara = configs.schedule(256, 32, 0.2, 32)
    for name in ["kara", "random", *configs.budget_policies()]:
        opts, per = configs.engine_options(name, kara)
        if name == "strided-test":
            opts = {k: v for k, v in opts.items() if not k.startswith("kara_strided")}
            opts["kara_policy"] = (
                "streaming"  # KaraConfig knows the flags of the built-ins
            )
        cfg, rest = KaraConfig.from_prefixed(dict(opts))
        assert rest == {} and cfg.spread == "off" and cfg.max_seqs == configs.MAX_SEQS
        if name in configs.budget_policies():
            assert per == {"match_kara": kara}
            if name != "strided-test":
                assert cfg.options.window <= 32  # w = min(its default, U)
        else:
            o = cfg.options
            assert (o.window, o.buffer, o.retention, o.period) == (256, 32, 0.2, 32)
            assert per is None
    with pytest.raises(ValueError, match="unknown policy"):
        configs.engine_options("no-such-policy", kara)


def test_chained_summary_counts_links_and_the_kara_trajectory():
    from sgl_kara.policies.trajectory import schedule_of, trajectory

    kara_spec = {
        "window": 64,
        "buffer": 16,
        "retention": 0.25,
        "period": 8,
        "recent": 0,
    }
    t = trajectory(schedule_of(kara_spec), 3072)

    def res(config, correct, consistent, g):
        row = {
            "request": 0,
            "problems": ["0.1", "0.2", "0.3"],
            "kinds": ["base", "base", "link"],
            "correct": correct,
            "answers": ["1", "2", "3"],
            "consistent": consistent,
            "completion_tokens": g,
            "finish": "stop",
            "kv_final": t.final(g) if config != "full" else g - 1,
            "kv_mean": t.mean(g) if config != "full" else (g - 2) / 2,
        }
        return {
            "config": config,
            "name": config,
            "ratio": None if config == "full" else 0.25,
            "kara_schedule": kara_spec,
            "max_new_tokens": 3072,
            "requests": [row],
        }

    full = res("full", [True, True, True], [None, None, True], 900)
    kara = res("kara", [True, False, False], [None, None, True], 800)
    stream = res("streaming", [True, True, False], [None, None, False], 850)
    row = summarize(stream, full, kara, early=1)
    assert (row["base_right"], row["links_right"], row["links_consistent"]) == (2, 0, 0)
    assert row["final_right"] == 0 and row["cons_kara_lost"] == 1
    assert row["kara_traj_final"] == row["kv_final"] == t.final(850)
    assert row["kara_run_final"] == t.final(800)


# ------------------------------------------------------------------ restated earlier answers


@pytest.mark.parametrize(
    "part, letter, value",
    [
        ("From Problem 1, we have \\( A = 40 \\). B = 16", "A", "40"),
        ("From Problem 1, we have \\( A = 40 \\). B = 16", "B", "16"),
        ("so A = $1,200 in all", "A", "1200"),
        ("A = -3.5 and then", "A", "-3.5"),
        (
            "A = \\frac{80}{4} = 20",
            "A",
            None,
        ),  # derived again: not restated as a number
        ("LAB = 5, then A is unknown", "A", None),
    ],
)
def test_a_restated_value_is_the_first_number_after_its_letter(part, letter, value):
    from bench.reasoning.recall import stated_value

    assert stated_value(part, letter) == value


def test_restatements_are_classified_against_the_models_own_answers():
    from bench.reasoning.recall import classify, edit_distance_is_one, restatements

    assert edit_distance_is_one("40", "42") and edit_distance_is_one("40", "4")
    assert edit_distance_is_one("140", "40") and not edit_distance_is_one("40", "40")
    assert not edit_distance_is_one("40", "24") and not edit_distance_is_one("4", "400")
    assert classify("40", "40") == "exact" and classify("40.0", "40") == "exact"
    assert classify("42", "40") == "one digit off" and classify("-42", "40") == "other"
    assert classify("7", "40") == "other" and classify(None, "40") == "not stated"
    assert classify("40", None) == "no answer"
    items = [
        {"kind": "base"},
        {"kind": "base"},
        {"kind": "link", "refs": [1, 2], "coefficients": [1, 3]},
    ]
    text = (
        "Problem 1: \\boxed{40}\nProblem 2: \\boxed{16}\n"
        "Problem 3: A = 42 and B = 16, so \\boxed{90}"
    )
    assert restatements(text, items, ["40", "16", "90"]) == ["one digit off", "exact"]
    assert restatements(text, items, [None, "16", "90"]) == ["no answer", "exact"]
    no_part = "Problem 1: \\boxed{40}\nProblem 2: \\boxed{16}"
    assert restatements(no_part, items, ["40", "16", None]) == ["no answer"] * 2


def test_the_chained_table_counts_restatements_from_the_kept_texts(tmp_path):
    text = "Problem 1: \\boxed{40}\nProblem 2: \\boxed{16}\nProblem 3: A = 42, B = 16: \\boxed{90}"
    _write_full(
        tmp_path,
        text,
        problems=["a", "b", "c"],
        golds=["40", "16", "88"],
        kinds=["base", "base", "link"],
        links={"3": {"refs": [1, 2], "coefficients": [1, 3]}},
        correct=[True, True, False],
        answers=["40", "16", "90"],
        consistent=[None, None, False],
    )
    args = SimpleNamespace(out=str(tmp_path), early=1, model="tiny", dtype="float32")
    long_answers.report(args)
    md = (tmp_path / "long_answers.md").read_text()
    assert "| full | 1 | 1 | 0 | 0 | 0 | 1/2 |" in md


def test_paired_difference_and_its_interval():
    from bench.reasoning import stats

    d, lo, hi = stats.paired_difference(3, 17, 180)
    # (3 - 17) / 180; se = sqrt(20/180 - d^2) / sqrt(180)
    se = ((20 / 180 - d * d) / 180) ** 0.5
    assert d == pytest.approx(-14 / 180)
    assert (lo, hi) == pytest.approx(
        (d - 1.959963984540054 * se, d + 1.959963984540054 * se)
    )
    assert round(100 * lo, 1) == -12.5 and round(100 * hi, 1) == -3.0
    assert stats.paired_difference(0, 0, 10) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        stats.paired_difference(6, 5, 10)
    p = stats.paired([True, True, False, False], [True, False, True, True])
    assert (p["won"], p["lost"], p["diff"]) == (2, 1, 0.25)
    assert long_answers.pair_cell({"kara_" + k: v for k, v in p.items()}, "kara_") == (
        f"2 / 1 ({p['mcnemar_p']:.3f}); +25.0 [{100 * p['diff_lo']:+.1f}, "
        f"{100 * p['diff_hi']:+.1f}]"
    )
    assert long_answers.pair_cell({}) == "-"
