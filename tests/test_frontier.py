"""The accuracy-KV frontier: points paired with full KV per workload and pooled, the preset rule,
the table and the plot, from result files written as the long-answer harness writes them. Pure."""

from __future__ import annotations

import pytest

from bench.reasoning import frontier, long_answers, stats


def _result(
    config, ratio, workload, correct, kv_mean, kv_final, tokens=1001, window=256
):
    """One request per problem (ids 0..n-1), each ``tokens`` long."""
    name = "full" if config == "full" else f"{config}_r{ratio:g}"  # the harness's name
    reqs = [
        {
            "request": i,
            "problems": [i],
            "correct": [ok],
            "answers": ["1"],
            "completion_tokens": tokens,
            "finish": "stop",
            "kv_final": kv_final,
            "kv_peak": kv_final,
            "kv_mean": kv_mean,
        }
        for i, ok in enumerate(correct)
    ]
    return name, {
        "config": config,
        "name": name,
        "ratio": ratio,
        "workload": workload,
        "kara_schedule": None if config == "full" else {"window": window},
        "requests": reqs,
    }


def _write(tmp_path, sub, *results):
    d = tmp_path / sub
    d.mkdir(parents=True, exist_ok=True)
    for name, res in results:
        long_answers.write_result(str(d / (name + ".json.gz")), res)
    return str(d)


def test_points_pair_with_full_kv_per_workload_and_pooled(tmp_path):
    full_i = [True] * 6 + [False] * 4
    full_c = [True] * 5 + [False] * 5
    ind = _write(
        tmp_path,
        "ind",
        _result("full", None, "independent", full_i, 499.5, 1000),
        _result("kara", 0.2, "independent", [False] * 2 + full_i[2:], 150, 250),
    )
    # the sweep's directory holds no full KV: paired with the other directory's
    sweep = _write(
        tmp_path,
        "sweep",
        _result("kara", 0.5, "independent", full_i, 300, 500),
    )
    chd = _write(
        tmp_path,
        "ch",
        _result("full", None, "chained", full_c, 499.5, 1000),
        _result("kara", 0.2, "chained", full_c, 150, 250),
        _result("kara", 0.5, "chained", [False] + full_c[1:], 300, 500),
        _result("rkv", 0.2, "chained", [True] * 10, 150, 250),
    )
    _write(tmp_path, "ind", _result("rkv", 0.2, "independent", [True] * 10, 150, 250))
    full, points = frontier.load({"independent": [ind, sweep], "chained": [chd]})
    table = {r["point"].name: r for r in frontier.rows(full, points)}
    k2 = table["kara_r0.2"]
    assert (k2["independent"]["solved"], k2["independent"]["lost"]) == (4, 2)
    assert k2["independent"]["kv_mean"] == pytest.approx(150 / 499.5)
    assert k2["independent"]["kv_final"] == pytest.approx(250 / 1000)
    pooled = k2["pooled"]
    assert (pooled["n"], pooled["solved"], pooled["full_solved"]) == (20, 9, 11)
    want = stats.paired(full_i + full_c, [False] * 2 + full_i[2:] + full_c)
    assert pooled["diff"] == pytest.approx(want["diff"])
    assert pooled["lo"] == pytest.approx(want["diff_lo"])
    assert table["kara_r0.5"]["pooled"]["lost"] == 1
    # against Kara at the same r: R-KV right on all 20, Kara on 9
    assert "vs_kara" not in k2 and "vs_kara" not in table["kara_r0.5"]
    vs = table["rkv_r0.2"]["vs_kara"]
    assert (vs["won"], vs["lost"], vs["diff"]) == (11, 0, pytest.approx(11 / 20))
    assert table["rkv_r0.2"]["vs_kara_on"] == "pooled"
    # r 0.5 loses 5 points [-14.6, +4.6]: not within a 5-point lower bound; r 0.2 neither
    kara = [r for r in table.values() if r["point"].policy == "kara"]
    best, closest = frontier.preset(kara, 0.02, 0.05)
    assert best is None and closest["point"].name == "kara_r0.5"
    best, _ = frontier.preset(kara, 0.06, 0.15)
    assert best["point"].name == "kara_r0.5"
    best, _ = frontier.preset(kara, 0.20, 0.30)
    assert best["point"].name == "kara_r0.2"  # the least KV among those that qualify
    best, _ = frontier.preset(list(table.values()), 0.02, 0.05)
    assert best["point"].name == "rkv_r0.2"  # +45 points: any policy qualifies


def test_a_point_on_one_workload_is_no_candidate_and_the_command_writes_both_files(
    tmp_path,
):
    full_i = [True, False] * 5
    ind = _write(
        tmp_path,
        "ind",
        _result("full", None, "independent", full_i, 499.5, 1000),
        _result("rkv", 0.3, "independent", full_i, 200, 300),
        _result("kara", 0.3, "independent", full_i, 200, 300, window=512),
    )
    _write(  # the W 512 runs in a directory of their own: the same names
        tmp_path,
        "w512",
        _result("rkv", 0.3, "independent", [True] * 10, 200, 300, window=512),
    )
    out = tmp_path / "out"
    w512 = str(tmp_path / "w512")
    table = frontier.main(["--independent", ind, w512, "--out", str(out)])
    assert all("pooled" not in r for r in table)
    rkv = next(r for r in table if r["point"].name == "rkv_r0.3")
    assert "vs_kara" not in rkv  # Kara ran at W 512 only
    rkv = next(r for r in table if r["point"].name == "rkv_w512_r0.3")
    assert rkv["vs_kara_on"] == "independent" and rkv["vs_kara"]["won"] == 5
    text = (out / "frontier.md").read_text()
    assert "| rkv r 0.3 | 5/10 | +0.0" in text
    assert "(5 / 0, p 0.062) (independent only) |" in text
    assert "No point is measured on both workloads yet" in text
    assert "| kara W 512 r 0.3 | 5/10 | +0.0" in text
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    alone = _write(tmp_path, "alone", _result("rkv", 0.3, "chained", [True], 1, 1))
    with pytest.raises(SystemExit):
        frontier.main(["--chained", alone, "--out", str(out)])  # no chained full KV


def test_two_results_of_one_name_in_a_workload_are_an_error(tmp_path):
    a = _write(tmp_path, "a", _result("kara", 0.2, "independent", [True], 1, 1))
    b = _write(tmp_path, "b", _result("kara", 0.2, "independent", [True], 1, 1))
    with pytest.raises(ValueError, match="twice"):
        frontier.load({"independent": [a, b]})
