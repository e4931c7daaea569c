"""The GSM8K accuracy harness (bench/reasoning/): grading, statistics against scipy, budget
matching, every configuration's options as sgl_kara validates them, the table, and one short
end-to-end run on a tiny model that is interrupted and resumed (no timed assertion)."""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile
from fractions import Fraction

import pytest

from bench.reasoning import data, gsm8k, stats
from bench.reasoning.grading import extract, gold_number, grade, last_boxed, to_number

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "text, answer, value",
    [
        (r"... so she has \boxed{18} eggs.", "18", 18),
        (r"\boxed{\$1,250.00}", r"\$1,250.00", 1250),
        (r"\boxed{18 \text{ dollars}}", r"18 \text{ dollars}", 18),
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}", Fraction(3, 4)),
        (r"\boxed{50\%}", r"50\%", 50),
        (r"first \boxed{3} then \boxed{-7.5}", "-7.5", Fraction(-15, 2)),
        ("The answer is\n#### 1,000,000\n", "1,000,000", 1_000_000),
        (r"\boxed{3 and 4}", "3 and 4", None),  # two numbers: no single answer
        (r"\boxed{\text{no}}", r"\text{no}", None),
        (r"the answer is 42", None, None),  # neither \boxed{} nor ####
        (r"\boxed{42", None, None),  # never closed
    ],
)
def test_extraction(text, answer, value):
    assert extract(text) == answer
    assert to_number(answer) == value


def test_last_boxed_reads_nested_braces_and_the_last_box():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no answer") is None and last_boxed(r"\boxed{1") is None


def test_grading_is_exact_on_the_number():
    gold = gold_number("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18")
    assert gold == 18
    assert grade(r"\boxed{18.00}", gold) == (True, "18.00")
    assert grade(r"\boxed{18.5}", gold) == (False, "18.5")
    assert grade(r"I think 18", gold) == (False, None)
    with pytest.raises(ValueError, match="no gold number"):
        gold_number("no hashes here")


@pytest.mark.parametrize(
    "k, n", [(0, 10), (3, 10), (11, 24), (50, 100), (100, 100), (1, 1)]
)
def test_wilson_equals_scipy(k, n):
    from scipy.stats import binomtest

    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = stats.wilson(k, n)
    assert lo == pytest.approx(ref.low, abs=1e-9) and hi == pytest.approx(
        ref.high, abs=1e-9
    )


@pytest.mark.parametrize(
    "b, c", [(0, 0), (0, 1), (3, 10), (10, 3), (7, 7), (0, 25), (12, 30)]
)
def test_mcnemar_equals_the_exact_binomial_test(b, c):
    from scipy.stats import binomtest

    ref = 1.0 if b + c == 0 else binomtest(b, b + c, 0.5).pvalue
    assert stats.mcnemar_exact(b, c) == pytest.approx(ref, rel=1e-12)


def test_paired_counts():
    full = [True, True, False, False, True, False]
    other = [True, False, True, False, False, False]
    p = stats.paired(full, other)
    assert (p["won"], p["lost"], p["both_right"], p["both_wrong"]) == (1, 2, 1, 2)
    assert p["mcnemar_p"] == stats.mcnemar_exact(1, 2) == 1.0
    with pytest.raises(ValueError):
        stats.paired(full, other[:-1])


def test_threshold_budgets_meet_karas_mean_kv():
    """The smallest budget whose threshold schedule's mean generated KV over Kara's decode steps
    reaches Kara's measured mean (a budget one lower falls short, unless at the floor)."""
    from bench.quality.real_lm import threshold_mean_kv

    means_lengths = [
        (89.5, 300),
        (149.0, 300),
        (44.0, 90),
        (120.0, 640),
        (95.70588235294119, 256),
    ]
    rows = [{"kv_mean": m, "completion_tokens": g} for m, g in means_lengths]
    gap, floor = 112, 24
    budgets = gsm8k.threshold_budgets(rows, gap, floor)
    for r, n in zip(rows, budgets):
        steps = r["completion_tokens"] - 1
        assert n >= floor and threshold_mean_kv(n, gap, steps) >= r["kv_mean"]
        assert n == floor or threshold_mean_kv(n - 1, gap, steps) < r["kv_mean"]
    assert (
        budgets[2] == floor
    )  # a short answer Kara never compressed: the baseline never does either


def _args(**kw):
    base = dict(
        max_total_tokens=20000,
        max_running=16,
        window=128,
        buffer=16,
        period=32,
        recent=256,
    )
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("config", gsm8k.CONFIGS)
def test_every_configuration_is_what_sgl_kara_resolves(config):
    """Each configuration's keywords as sgl_kara.Engine validates them (KaraConfig.from_prefixed):
    the right policy, W / U / delta / r, the band, the budgets per request, events whole."""
    from sgl_kara.config import KaraConfig

    kara_rows = [
        {"kv_mean": 89.5, "completion_tokens": 300},
        {"kv_mean": 60.0, "completion_tokens": 200},
    ]
    opts, per_request = gsm8k.engine_options(config, 0.25, _args(), kara_rows)
    cfg, rest = KaraConfig.from_prefixed(dict(opts))
    assert rest == {"max_total_tokens": 20000, "max_running_requests": 16}
    if config == "full":
        assert cfg.policy == "none" and per_request is None
        return
    assert cfg.policy == {"kara-band": "kara"}.get(config, config)
    assert cfg.query_source == "capture"
    whole = gsm8k.WHOLE_EVENTS
    assert whole and all(
        getattr(cfg, k.removeprefix("kara_")) == v for k, v in whole.items()
    )
    o = cfg.options
    if config in ("kara", "kara-band", "random"):
        assert (o.window, o.buffer, o.period, o.retention) == (
            128,
            16,
            32,
            0.25,
        ) and per_request is None
        assert o.recent == (256 if config == "kara-band" else 0)
    else:
        assert o.threshold - o.budget == 128 - 16  # the trigger gap W - U
        assert per_request == [
            {"budget": b} for b in gsm8k.threshold_budgets(kara_rows, 112, o.budget)
        ]
        with pytest.raises(SystemExit, match="needs the kara run"):
            gsm8k.engine_options(config, 0.25, _args(), None)


def _result(config, ratio, correct, lengths, kv_mean=None, budgets=None):
    probs = []
    for i, (c, g) in enumerate(zip(correct, lengths)):
        r = {
            "id": i,
            "correct": c,
            "answer": None if c is None else "1",
            "completion_tokens": g,
            "compressions": 0,
            "kv_peak": g - 1,
            "kv_mean": kv_mean if kv_mean is not None else (g - 2) / 2,
        }
        if budgets:
            r["budget"] = budgets[i]
        probs.append(r)
    for r in probs:
        r["correct"] = bool(r["correct"])
    return {
        "config": config,
        "ratio": ratio,
        "name": gsm8k.result_name(config, ratio),
        "max_new_tokens": 100,
        "sessions": [
            {
                "problems": len(probs),
                "tokens": sum(lengths),
                "seconds": 10.0,
                "cpu_seconds": 5.0,
            }
        ],
        "problems": probs,
    }


def test_summary_and_table(tmp_path):
    full = _result(
        "full", None, [True, True, False, True, None], [50, 100, 80, 60, 100]
    )
    kara = _result(
        "kara",
        0.25,
        [True, False, True, False, False],
        [50, 90, 80, 100, 30],
        kv_mean=20.0,
    )
    snap = _result(
        "snapkv",
        0.25,
        [False, True, True, True, True],
        [50, 90, 80, 100, 30],
        budgets=[8] * 5,
    )
    for res in (full, kara, snap):
        with open(tmp_path / f"{res['name']}.json", "w") as f:
            json.dump(res, f)
    args = argparse.Namespace(out=str(tmp_path), max_new_tokens=100, model_path="m")
    rows = {r["config"]: r for r in gsm8k.report(args)}
    k = rows["kara"]
    assert (k["correct"], k["n"], k["won"], k["lost"]) == (2, 5, 1, 2)
    assert k["mcnemar_p"] == stats.mcnemar_exact(1, 2)
    assert (k["lo"], k["hi"]) == stats.wilson(2, 5)
    assert (
        rows["full"]["truncated"] == 2 and k["truncated"] == 1
    )  # answers that reached max_new_tokens
    assert rows["full"]["no_answer"] == 1 and k["kv_mean"] == 20.0
    assert (
        k["tok_s"] == sum([50, 90, 80, 100, 30]) / 10.0 and k["tok_cpu_s"] == 350 / 5.0
    )
    table = (tmp_path / "gsm8k.md").read_text()
    assert (
        "| full | - | 3/5 = 0.60" in table
        and "| kara | 0.25 | 2/5 = 0.40" in table
        and "| 1 / 2 |" in table
    )
    # a baseline is paired with full KV and with Kara at its ratio; Kara and full not with Kara
    sn = rows["snapkv"]
    assert (sn["won"], sn["lost"], sn["kara_won"], sn["kara_lost"]) == (2, 1, 3, 1)
    assert (
        sn["kara_p"] == stats.mcnemar_exact(3, 1)
        and "kara_won" not in k
        and "kara_won" not in rows["full"]
    )
    assert f"| 3 / 1 ({stats.mcnemar_exact(3, 1):.3f}) |" in table


def test_a_wrong_wheel_is_refused(tmp_path):
    wheel = tmp_path / data.WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(data.PREFIX + "instruction.toml", 'instruction = "x"\n')
    with pytest.raises(RuntimeError, match="sha256 .* expected"):
        data.read_wheel(wheel)


PROBLEMS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {
        "question": "Tom has 4 apples and eats 1. How many are left?",
        "answer": "4 - 1 = 3\n#### 3",
    },
    {"question": "What is 6 times 7?", "answer": "#### 42"},
]


@pytest.mark.slow
@pytest.mark.harness  # three engines: a benchmark's smoke run (docs/TESTING.md, tiers)
def test_end_to_end_interrupted_and_resumed(tiny_llama, tmp_path):
    """full, kara and snapkv on a tiny model (answers are noise; the plumbing is checked): a kara
    run interrupted after one answer is resumed without answering it again; the baseline's
    per-problem budgets come from Kara's results; every file and the run record are written."""
    src = tmp_path / "problems.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    out = tmp_path / "out"
    common = [
        "--model",
        tiny_llama,
        "--problems",
        str(src),
        "--out",
        str(out),
        "--max-new-tokens",
        "120",
        "--window",
        "40",
        "--buffer",
        "8",
        "--period",
        "4",
        "--max-running",
        "4",
    ]
    gsm8k.main(common + ["--configs", "full"])
    full = json.loads((out / "full.json").read_text())
    assert [p["id"] for p in full["problems"]] == [0, 1, 2]
    # An interrupted kara run: one answer already in its partial file (marked, so we see it kept).
    seeded = dict(
        full["problems"][0], text="seeded", compressions=-1, kv_mean=1.0, kv_peak=1
    )
    out.joinpath("kara_r0.25.partial.jsonl").write_text(json.dumps(seeded) + "\n")
    rows = {
        r["config"]: r for r in gsm8k.main(common + ["--configs", "kara", "snapkv"])
    }
    kara = json.loads((out / "kara_r0.25.json").read_text())
    assert kara["sessions"][0]["problems"] == 2  # only the two unanswered problems ran
    assert kara["problems"][0]["compressions"] == -1
    with gzip.open(out / "kara_r0.25.answers.jsonl.gz", "rt") as f:
        assert json.loads(f.readline())["text"] == "seeded"
    long = [p for p in kara["problems"][1:] if p["completion_tokens"] > 60]
    assert long and all(
        p["compressions"] > 0 and p["kv_peak"] < p["completion_tokens"] - 1
        for p in long
    )
    snap = json.loads((out / "snapkv_r0.25.json").read_text())
    assert [p["budget"] for p in snap["problems"]] == gsm8k.threshold_budgets(
        kara["problems"], 32, 16
    )
    assert (
        set(rows) == {"full", "kara", "snapkv"}
        and rows["kara"]["n"] == 3
        and "won" in rows["snapkv"]
    )
    assert not list(out.glob("*.partial.jsonl"))
    record = json.loads((out / "run-2.json").read_text())
    assert set(record["configs"]) == {"kara_r0.25", "snapkv_r0.25"}
    assert (
        record["configs"]["kara_r0.25"]["kara"]["policy"] == "kara"
        and record["git"]["commit"]
    )
    assert record["notes"]["whole_events"] == gsm8k.WHOLE_EVENTS
    # Nothing left to do: a rerun starts no engine and writes the same table.
    before = (out / "gsm8k.json").read_text()
    gsm8k.main(common + ["--configs", "full", "kara", "snapkv"])
    assert (out / "gsm8k.json").read_text() == before
    assert (out / "kara_r0.25.json").read_text().count(
        '"problems": 2'
    ) == 1  # still the one session
