"""Where a throughput ratio comes from: per-step costs from a run's KARA_TRACE lines.

Each trace record is written when the scheduler has picked the next decode batch: its running
requests B, the KV rows they hold (``rows``: what attention reads), the requests waiting for
admission and the scheduler's CPU clock (``cpu``). The interval to the next record is that
batch's step, with any compression event (``kara_seconds`` grows by its time) or prefill folded
in. So per interval:

    tokens = B (one per running request)     cpu = cpu[next] - cpu[this]     event = kara[next] - kara[this]

Two uses (bench/throughput_grid.py):

- **saturated phase**: tokens per scheduler CPU-second over the intervals where a request waited
  for admission -- the rate of a server whose queue does not empty, without the batch's drain;
- **step-cost model**: a decode step costs ``a + b B + c rows`` CPU-seconds, fitted by least
  squares to the event-free, admission-free intervals of vanilla's and one compressing system's
  runs in a cell; it splits each ratio into concurrency, shorter rows and compression, and
  predicts the ratio Kara would reach at its footprint limit.

No SGLang import: pure functions on trace dicts (tests/test_throughput_harness.py).
"""

from __future__ import annotations

from dataclasses import dataclass


def intervals(trace: list[dict]) -> list[dict]:
    """One dict per decode step with a successor record: running, rows, waiting, cpu, event
    (compression seconds within), admitted (a prefill ran: more running or fewer waiting next).
    Records without ``cpu`` (traces written before it was recorded) give nothing."""
    out = []
    for cur, nxt in zip(trace, trace[1:]):
        if cur["running"] <= 0 or "cpu" not in cur or "cpu" not in nxt:
            continue
        out.append(
            dict(
                running=cur["running"],
                rows=cur.get("rows", 0),
                waiting=cur.get("waiting", 0),
                cpu=nxt["cpu"] - cur["cpu"],
                event=nxt.get("kara_seconds", 0.0) - cur.get("kara_seconds", 0.0),
                admitted=nxt["running"] > cur["running"]
                or nxt.get("waiting", 0) < cur.get("waiting", 0),
            )
        )
    return out


def rate(ivs: list[dict]) -> dict | None:
    """Tokens per CPU-second over some intervals, mean running, rows per request, event share."""
    cpu = sum(iv["cpu"] for iv in ivs)
    if not ivs or cpu <= 0:
        return None
    tokens = sum(iv["running"] for iv in ivs)
    return dict(
        tps=tokens / cpu,
        tokens=tokens,
        running=tokens / len(ivs),
        rows_per_request=sum(iv["rows"] for iv in ivs) / tokens,
        event_share=sum(iv["event"] for iv in ivs) / cpu,
        steps=len(ivs),
        cpu=cpu,
    )


def saturated(ivs: list[dict]) -> dict | None:
    """``rate`` over the intervals at which a request waited for admission (None if none did)."""
    return rate([iv for iv in ivs if iv["waiting"] > 0])


@dataclass(frozen=True)
class StepCost:
    """A decode step's CPU seconds: ``fixed + per_request * B + per_row * rows``."""

    fixed: float
    per_request: float
    per_row: float
    r2: float  # of the fit
    n: int  # intervals fitted

    def step(self, running: float, rows_per_request: float) -> float:
        return (
            self.fixed
            + self.per_request * running
            + self.per_row * running * rows_per_request
        )

    def tps(self, running: float, rows_per_request: float) -> float:
        """Tokens per CPU-second of steps at this batch and row length (no events)."""
        return running / self.step(running, rows_per_request)


def fit_stats(ivs: list[dict]) -> dict:
    """Sufficient statistics of the least-squares fit of decode CPU per step on (1, B, rows), over the
    intervals without an event or an admission (those fold other work into the step). Statistics of
    several runs add up (``fit`` takes a list): a cell's systems are fitted jointly without keeping
    their traces."""
    use = [iv for iv in ivs if iv["event"] == 0 and not iv["admitted"]]
    xs = [(1.0, float(iv["running"]), float(iv["rows"])) for iv in use]
    ys = [iv["cpu"] for iv in use]
    return dict(
        n=len(use),
        xtx=[[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)],
        xty=[sum(x[i] * y for x, y in zip(xs, ys)) for i in range(3)],
        sy=sum(ys),
        syy=sum(y * y for y in ys),
    )


def fit(stats: list[dict]) -> StepCost | None:
    """The step-cost model from one or more runs' ``fit_stats``, the same coefficients for every run
    (the systems run the same model through the same code; a compressing system's own per-step
    hooks are not fitted -- a py-spy profile measured them, bench/results/throughput.md -- since
    with equal output lengths vanilla's batch is constant and such a term would trade off against
    the per-request cost).
    None when the runs do not determine the coefficients (fewer than 8 intervals, or B and rows
    never vary independently)."""
    import numpy as np

    n = sum(s["n"] for s in stats)
    if n < 8:
        return None
    xtx = sum(np.array(s["xtx"]) for s in stats)
    xty = sum(np.array(s["xty"]) for s in stats)
    d = np.sqrt(np.diag(xtx))
    if (d == 0).any() or np.linalg.cond(
        xtx / np.outer(d, d)
    ) > 1e8:  # scale-free: B and rows collinear
        return None
    coef = np.linalg.solve(xtx, xty)
    sy, syy = sum(s["sy"] for s in stats), sum(s["syy"] for s in stats)
    sse = syy - 2 * coef @ xty + coef @ xtx @ coef  # sum of squared residuals
    total = syy - sy * sy / n
    r2 = 1.0 - float(sse) / total if total > 0 else 1.0
    return StepCost(float(coef[0]), float(coef[1]), float(coef[2]), r2, n)


def explain(
    model: StepCost, base: dict, other: dict, limit_running: float | None = None
) -> dict:
    """A ratio of saturated rates split into its parts with the step-cost model.

    ``base`` / ``other``: ``rate`` dicts (vanilla's and a compressing system's). ``predicted`` is the
    model's ratio at the measured batches and rows, less ``other``'s event share; ``same_batch`` the
    ratio at vanilla's batch (what shorter rows alone buy), ``batching`` the gain of running
    ``other``'s batch at vanilla's rows (what concurrency alone buys on this machine), and
    ``at_limit`` the ratio at ``limit_running`` requests (the footprint limit) with no event time:
    what the machine allows at that concurrency."""
    b0 = model.tps(base["running"], base["rows_per_request"])
    out = dict(
        predicted=model.tps(other["running"], other["rows_per_request"])
        * (1 - other["event_share"])
        / b0,
        same_batch=model.tps(base["running"], other["rows_per_request"]) / b0,
        batching=model.tps(other["running"], base["rows_per_request"]) / b0,
        concurrency=other["running"] / base["running"],
        fixed_share=model.fixed / model.step(base["running"], base["rows_per_request"]),
    )
    if limit_running is not None:
        out["at_limit"] = model.tps(limit_running, other["rows_per_request"]) / b0
    return out
