"""The accuracy-KV frontier on long answers: every configuration against full KV, per workload and
pooled over both, beside the generated KV it held; the preset rule; one plot. No engine.

Each point is one configuration (a result name such as ``kara_r0.3``, a policy at a retention, Kara's
window in the label where it is not 256) found in the result directories of a workload
(bench/reasoning/long_answers.py writes them); full KV's result is the one ``full`` among them.
Per workload and pooled (the problems of both workloads as one paired set):

    solved          problems right, of those graded
    vs full KV      paired difference, points, with its 95% interval (bench/reasoning/stats.py)
    generated KV    the share of full KV's generated KV the configuration held at the same answer
                    lengths, mean over the answer and at its end, averaged over requests

The preset rule: the point of least pooled mean generated KV whose pooled difference against full
KV is at least ``--max-loss`` points (2) with a 95% lower bound at least ``--max-low`` (5 below).
A point measured on one workload only is not a candidate.

    python -m bench.reasoning.frontier --independent DIR [DIR ...] --chained DIR [DIR ...] --out DIR

writes OUT/frontier.md (the table, the preset or the closest point and its cost) and
OUT/frontier.png (accuracy against mean generated KV, a line per policy and window, full KV's
95% band, one panel per workload).
"""

from __future__ import annotations

import argparse
import io
import os
from dataclasses import dataclass, field

from bench.reasoning import gsm8k, long_answers, stats

WORKLOADS = ("independent", "chained")


@dataclass
class Point:
    """One configuration: its results per workload (``long_answers`` result dicts)."""

    name: str
    policy: str
    ratio: float | None
    window: int | None
    results: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.policy == "full":
            return "full KV"
        w = "" if self.window in (None, WINDOW) else f" W {self.window}"
        return f"{self.policy}{w} r {self.ratio:g}"

    @property
    def line(self) -> str:
        """The plot's line: a policy at one window."""
        return self.label.rsplit(" r ", 1)[0]


WINDOW = 256  # Kara's W named in no point's key or label


def point_key(config: str, ratio: float | None, window: int | None) -> str:
    """A point's name: its configuration, Kara's W where it is not 256, its r (``kara_r0.3``,
    ``kara_w512_r0.2``; full KV: ``full``)."""
    if config == "full":
        return "full"
    w = "" if window in (None, WINDOW) else f"_w{window}"
    return f"{config}{w}_r{ratio:g}"


def load(dirs: dict[str, list[str]]) -> tuple[dict[str, dict], dict[str, Point]]:
    """(full KV's result per workload, the other points by name) from the directories of each
    workload; a name found twice in one workload is an error."""
    full, points = {}, {}
    for workload, paths in dirs.items():
        for path in paths:
            for name in gsm8k.result_names(path, long_answers.NOT_RESULTS):
                res = gsm8k.load_result(path, name)
                if res is None or "requests" not in res:
                    continue
                if name == "full":
                    if workload in full:
                        raise ValueError(f"{workload}: two full KV results ({path})")
                    full[workload] = res
                    continue
                opts = res.get("engine_options") or {}
                window = (res.get("kara_schedule") or {}).get("window")
                window = window or opts.get("kara_window")
                key = point_key(res["config"], res.get("ratio"), window)
                point = Point(key, res["config"], res.get("ratio"), window)
                point = points.setdefault(key, point)
                if workload in point.results:
                    raise ValueError(f"{workload}: {key} found twice ({path})")
                point.results[workload] = res
    return full, points


def kv_shares(result: dict) -> tuple[float, float]:
    """(mean, final) generated KV as a share of full KV's at the same answer lengths, averaged
    over the result's requests."""
    shares = [long_answers.retention(r) for r in result["requests"]]
    return (
        sum(m for _, m in shares) / len(shares),
        sum(f for f, _ in shares) / len(shares),
    )


def paired_with_full(full: dict, result: dict) -> tuple[list[bool], list[bool]]:
    """(the reference's grades -- full KV's, or another configuration's --, the result's) on the
    same problems, in one order; an error when the two graded other problems."""
    ref, mine = long_answers.per_problem(full), long_answers.per_problem(result)
    if set(ref) != set(mine):
        raise ValueError(
            f"{result.get('name')}: other problems than {full.get('name')}'s"
        )
    ids = sorted(mine, key=str)
    return [ref[i][0] for i in ids], [mine[i][0] for i in ids]


def cell(full: dict, results: list[tuple[str, dict]]) -> dict:
    """Solved, the paired difference against the reference (``full``: its result per workload,
    full KV's or another configuration's) and the KV shares over ``results`` ((workload,
    result) pairs; several: pooled, the problems and requests of all)."""
    a, b, requests = [], [], []
    for workload, res in results:
        x, y = paired_with_full(full[workload], res)
        a += x
        b += y
        requests += res["requests"]
    p = stats.paired(a, b)
    mean, final = kv_shares({"requests": requests})
    out = dict(solved=sum(b), n=len(b), full_solved=sum(a), diff=p["diff"])
    out.update(lo=p["diff_lo"], hi=p["diff_hi"], won=p["won"], lost=p["lost"])
    return dict(out, p=p["mcnemar_p"], kv_mean=mean, kv_final=final)


def rows(full: dict, points: dict[str, Point]) -> list[dict]:
    """One row per point: its cells per workload and pooled (where both were measured), and the
    paired difference against Kara at the same W and r (``vs_kara``) over the workloads both measured
    (``vs_kara_on``: pooled when both, else the one)."""
    out = []
    for point in points.values():
        row = {"point": point}
        for w in WORKLOADS:
            if w in point.results and w in full:
                row[w] = cell(full, [(w, point.results[w])])
        if all(w in row for w in WORKLOADS):
            row["pooled"] = cell(full, [(w, point.results[w]) for w in WORKLOADS])
        kara = points.get(point_key("kara", point.ratio, point.window))
        shared = [] if kara in (None, point) else [w for w in WORKLOADS if w in row]
        shared = [w for w in shared if w in kara.results]
        if shared:
            row["vs_kara"] = cell(kara.results, [(w, point.results[w]) for w in shared])
            row["vs_kara_on"] = "pooled" if len(shared) == len(WORKLOADS) else shared[0]
        out.append(row)
    out.sort(key=lambda r: (r["point"].line, r["point"].ratio or 0))
    return out


def preset(
    table: list[dict], max_loss: float, max_low: float
) -> tuple[dict | None, dict]:
    """(the qualifying row of least pooled mean KV or None, the pooled row closest to
    qualifying: the largest lower bound)."""
    pooled = [r for r in table if "pooled" in r]
    ok = [
        r
        for r in pooled
        if r["pooled"]["diff"] >= -max_loss and r["pooled"]["lo"] >= -max_low
    ]
    best = min(ok, key=lambda r: r["pooled"]["kv_mean"]) if ok else None
    closest = max(pooled, key=lambda r: r["pooled"]["lo"]) if pooled else None
    return best, closest


def _cell_text(c: dict | None) -> str:
    kv = (
        None if c is None else f"{100 * c['kv_mean']:.0f}% / {100 * c['kv_final']:.0f}%"
    )
    return "- | - | -" if c is None else f"{c['solved']}/{c['n']} | {_versus(c)} | {kv}"


def _versus(c: dict | None) -> str:
    if c is None:
        return "-"
    return (
        f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] "
        f"({c['won']} / {c['lost']}, p {c['p']:.3f})"
    )


def _on(row: dict) -> str:
    on = row.get("vs_kara_on")
    return "" if on in (None, "pooled") else f" ({on} only)"


def markdown(full: dict, table: list[dict], max_loss: float, max_low: float) -> str:
    cols = [w for w in (*WORKLOADS, "pooled") if any(w in r for r in table)]
    head = "| configuration | " + " | ".join(
        f"{w}: solved | {w}: vs full KV, points [95%] (won / lost, p) | "
        f"{w}: generated KV mean / final"
        for w in cols
    )
    head += " | vs Kara at the same r, points [95%] (won / lost, p): pooled, else the workload"
    lines = [head + " |", "|---|" + "---|---|---|" * len(cols) + "---|"]
    full_cells = []
    for w in cols:
        if w == "pooled":
            solved = sum(
                sum(ok for ok, _ in long_answers.per_problem(f).values())
                for f in full.values()
            )
            n = sum(len(long_answers.per_problem(f)) for f in full.values())
        else:
            probs = long_answers.per_problem(full[w]) if w in full else {}
            solved, n = sum(ok for ok, _ in probs.values()), len(probs)
        full_cells.append(f"{solved}/{n} | - | 100% / 100%")
    lines.append("| full KV | " + " | ".join(full_cells) + " | - |")
    for r in table:
        lines.append(
            f"| {r['point'].label} | "
            + " | ".join(_cell_text(r.get(w)) for w in cols)
            + f" | {_versus(r.get('vs_kara'))}{_on(r)} |"
        )
    best, closest = preset(table, max_loss / 100, max_low / 100)
    lines.append("")
    rule = (
        f"The preset rule: pooled difference against full KV at least -{max_loss:g} points "
        f"with a 95% lower bound at least -{max_low:g}, the least pooled mean generated KV."
    )
    if best is not None:
        c = best["pooled"]
        lines.append(
            f"{rule} **Preset: {best['point'].label}** ({100 * c['diff']:+.1f} points "
            f"[{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] at {100 * c['kv_mean']:.0f}% of "
            f"full KV's mean generated KV, {100 * c['kv_final']:.0f}% of its final)."
        )
    elif closest is not None:
        c = closest["pooled"]
        lines.append(
            f"{rule} **No point measured on both workloads qualifies**; the closest, "
            f"{closest['point'].label}, costs {100 * c['diff']:+.1f} points [{100 * c['lo']:+.1f}, "
            f"{100 * c['hi']:+.1f}] at {100 * c['kv_mean']:.0f}% of full KV's mean generated KV."
        )
    else:
        lines.append(f"{rule} No point is measured on both workloads yet.")
    return "\n".join(lines) + "\n"


def plot(full: dict, table: list[dict], path: str) -> None:
    """Accuracy against mean generated KV share, a line per policy and window, full KV's 95%
    Wilson band; one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [w for w in WORKLOADS if w in full]
    names = sorted({r["point"].line for r in table})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    palette += ["black", "gold", "navy", "lime"][: max(0, len(names) - len(palette))]
    color = {
        n: palette[i % len(palette)] for i, n in enumerate(names)
    }  # same in each panel
    fig, axes = plt.subplots(
        1, len(shown), figsize=(6 * len(shown), 4.5), squeeze=False
    )
    for ax, w in zip(axes[0], shown):
        probs = long_answers.per_problem(full[w])
        k, n = sum(ok for ok, _ in probs.values()), len(probs)
        lo, hi = stats.wilson(k, n)
        ax.axhspan(lo, hi, color="0.85", label="full KV, 95% interval")
        ax.axhline(k / n, color="0.4", lw=1)
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in table:
            if w in r:
                lines.setdefault(r["point"].line, []).append(
                    (100 * r[w]["kv_mean"], r[w]["solved"] / r[w]["n"])
                )
        for name, xy in sorted(lines.items()):
            xy.sort()
            ax.plot(*zip(*xy), marker="o", label=name, color=color[name])
        ax.set_title(f"{w} ({n} problems)")
        ax.set_xlabel("mean generated KV, % of full KV's")
        ax.set_ylabel("problems solved")
        ax.set_xlim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    png.seek(0)
    with Image.open(png) as im:  # a 256-colour palette: the same plot in fewer bytes
        im.convert("RGB").quantize(colors=256).save(path, optimize=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reasoning.frontier",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for w in WORKLOADS:
        ap.add_argument(f"--{w}", nargs="+", default=[], metavar="DIR")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-loss", type=float, default=2.0, help="points")
    ap.add_argument("--max-low", type=float, default=5.0, help="points")
    args = ap.parse_args(argv)
    dirs = {w: getattr(args, w) for w in WORKLOADS if getattr(args, w)}
    if not dirs:
        ap.error("name the result directories of at least one workload")
    full, points = load(dirs)
    missing = [w for w in dirs if w not in full]
    if missing:
        ap.error(f"no full KV result among the directories of {', '.join(missing)}")
    table = rows(full, points)
    os.makedirs(args.out, exist_ok=True)
    from bench.record import command_line, stamp

    with open(os.path.join(args.out, "frontier.md"), "w") as f:
        f.write(f"{stamp()}\ncommand: `{command_line(argv)}`\n\n")
        f.write(markdown(full, table, args.max_loss, args.max_low))
    plot(full, table, os.path.join(args.out, "frontier.png"))
    print(open(os.path.join(args.out, "frontier.md")).read(), flush=True)
    return table


if __name__ == "__main__":
    main()
