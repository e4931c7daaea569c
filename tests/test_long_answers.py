"""The long-answer workload: requests of several problems, split and graded per problem. Pure."""

from fractions import Fraction
from types import SimpleNamespace

import pytest

from bench.quality.real_lm import threshold_mean_kv
from bench.reasoning import workload
from bench.reasoning.long_answers import (
    band_ratio_at_equal_kv,
    final_budget,
    kara_replay,
    summarize,
)


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


def test_missing_or_out_of_order_parts_have_no_answer():
    text = "Problem 1: \\boxed{1}\nProblem 3: \\boxed{3}\nProblem 2: \\boxed{2}"
    # numbers must increase: heading 2 after heading 3 is no part (it ends part 3)
    parts = workload.split(text, 3)
    assert parts[1] is None and parts[2].startswith("Problem 3")
    assert "\\boxed{2}" not in parts[2]
    graded = workload.grade_request(text, [Fraction(1), Fraction(2), Fraction(3)])
    assert graded == [(True, "1"), (False, None), (True, "3")]
    # a repeated heading ends the part before it; later problems are still found
    text = "Problem 1: \\boxed{1}\nProblem 1: \\boxed{9}\nProblem 3: \\boxed{3}"
    assert workload.grade_request(text, [1, 2, 3]) == [
        (True, "1"),
        (False, None),
        (True, "3"),
    ]
    # a truncated answer: the later problems are unanswered
    cut = workload.grade_request("Problem 1: \\boxed{1}\nProblem 2: we", [1, 2, 3])
    assert cut == [(True, "1"), (False, None), (False, None)]


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
