"""SGLang's router (``sglang-router``) in front of two sgl_kara servers, all on 127.0.0.1.

The recipe of README "Scaling out": two ``python -m sgl_kara.launch_server`` workers (tiny Llama,
small Kara windows) and ``python -m sglang_router.launch_router --policy cache_aware``. A mixed
load (distinct prompts, two groups sharing a long prompt) must complete with compression on
both workers and prefix-cache hits inside each group; then one worker is killed (SIGKILL)
mid-load and what the router answers is measured: every request gets an answer, every 200 is
complete, and once the router's health check has marked the worker down every request succeeds
on the survivor. Run with ``-s`` for the ``ROUTER`` line of figures (notes/dp-RESULTS.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from support import Server, free_port, generate

pytestmark = pytest.mark.integration  # a server of its own (docs/TESTING.md, tiers)

pytest.importorskip(
    "sglang_router", reason="sglang-router is not installed (pip install sglang-router)"
)

WORKER_ARGS = [
    "--host",
    "127.0.0.1",
    "--max-total-tokens",
    "8192",
    "--max-running-requests",
    "16",
    "--kara-window",
    "16",
    "--kara-buffer",
    "4",
    "--kara-chunk-budget",
    "2",
    "--kara-max-chunk",
    "3",
    "--kara-period",
    "4",
]
HEALTH_INTERVAL = 1  # --health-check-interval-secs of the router (its default, 60 s, keeps a dead worker longer)
GROUPS = {
    "alpha": "Alpha report. " + "The river rises in the north and the mill turns. " * 8,
    "zulu": "Zulu ledger. " + "Seven crates of apples left the harbour at dawn. " * 8,
}


class Router:
    def __init__(self, workers: list[str], timeout: float = 120):
        self.port, prom = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(
            os.path.join(
                os.environ.get("TMPDIR", "/tmp"), f"sglang_router_{self.port}.log"
            ),
            "w",
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-urls",
                *workers,
                "--policy",
                "cache_aware",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(prom),
                "--worker-startup-check-interval",
                "1",
                "--health-check-interval-secs",
                str(HEALTH_INTERVAL),
                "--log-level",
                "warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + timeout
        while len(self.healthy()) < len(
            workers
        ):  # /health answers before the workers are registered
            assert self.proc.poll() is None, f"router exited; see {self.log.name}"
            assert time.time() < deadline, (
                f"router has not registered the workers; see {self.log.name}"
            )
            time.sleep(0.5)

    def healthy(self) -> set[str]:
        try:
            workers = requests.get(self.url + "/workers", timeout=5).json()["workers"]
        except (requests.RequestException, ValueError, KeyError):
            return set()
        return {w["url"] for w in workers if w.get("is_healthy")}

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    workers = [Server(["--model-path", tiny_llama, *WORKER_ARGS]) for _ in range(2)]
    router = None
    try:
        router = Router([w.url for w in workers])
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


def greedy(url: str, text: str, n: int) -> tuple[int, dict | str]:
    """(status, meta_info or the error's text) of ``n`` greedy tokens; status -1 if the connection failed."""
    try:
        r = generate(
            url, text, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        )
    except requests.RequestException as e:
        return -1, repr(e)
    return r.status_code, (
        r.json()["meta_info"] if r.status_code == 200 else r.text[:300]
    )


def kara_stats(worker) -> dict:
    return requests.get(worker.url + "/server_info", timeout=30).json()[
        "internal_states"
    ][0]["kara"]


def test_mixed_load_compresses_on_both_workers_with_prefix_hits(cluster):
    router, workers = cluster
    n = 96
    # Each group's first request alone: the router learns where the prompt lives.
    firsts = {g: greedy(router.url, p + "Question 0?", n) for g, p in GROUPS.items()}
    jobs = [(g, GROUPS[g] + f"Question {i}?") for g in GROUPS for i in range(1, 6)]
    jobs += [
        (None, f"{word} {i * 37} is a distinct prompt")
        for i, word in enumerate(
            [
                "Kettle",
                "Orbit",
                "Mango",
                "Violet",
                "Quartz",
                "Harbor",
                "Nimbus",
                "Pepper",
            ]
        )
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(
            pool.map(lambda job: (job[0], *greedy(router.url, job[1], n)), jobs)
        )
    for _group, (code, meta) in [(g, r) for g, r in firsts.items()] + [
        (g, (c, m)) for g, c, m in results
    ]:
        assert code == 200, meta
        assert meta["completion_tokens"] == n and meta["kara"]["compressions"] >= 5, (
            meta
        )
    for group, _code, meta in results:
        if group is not None:
            # the shared prompt is served from the radix cache of the worker the router chose
            assert meta["cached_tokens"] >= 0.8 * meta["prompt_tokens"], (group, meta)
    stats = [kara_stats(w) for w in workers]
    assert all(s["events"] > 0 and s["tokens_dropped"] > 0 for s in stats), stats


def test_killing_a_worker_mid_load(cluster):
    """What the router does when a worker dies under load, measured. Asserted: no request hangs,
    no 200 is truncated, every failure is an explicit 5xx, and once the health check marks the
    dead worker down every request succeeds on the survivor. Counted (ROUTER line): requests
    the dead worker held, and those routed to it before the check noticed, are re-sent by the
    router to the survivor (measured here: all completed) or answered with a 5xx."""
    router, workers = cluster
    victim, survivor = workers
    n = 1200
    words = [
        "Anchor",
        "Bramble",
        "Cobalt",
        "Dune",
        "Ember",
        "Fjord",
        "Granite",
        "Hollow",
        "Indigo",
        "Juniper",
        "Kelp",
        "Lantern",
    ]
    texts = [
        f"{w} {i}: " + ("let the numbers grow " * (i % 4 + 1))
        for i, w in enumerate(words)
    ]
    steps = kara_stats(victim)["decode_steps"]
    with ThreadPoolExecutor(len(texts) + 4) as pool:
        inflight = [pool.submit(greedy, router.url, t, n) for t in texts]
        deadline = time.time() + 60
        while (
            kara_stats(victim)["decode_steps"] < steps + 30
        ):  # the victim is decoding this load
            assert time.time() < deadline, (
                "the router sent none of the load to the victim"
            )
            time.sleep(0.2)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        killed = time.time()
        after = [
            pool.submit(greedy, router.url, f"After {i}: a new question", 64)
            for i in range(4)
        ]
        inflight = [f.result() for f in inflight]
        after = [f.result() for f in after]
    while victim.url in router.healthy():
        assert time.time() - killed < 30 * HEALTH_INTERVAL + 30, (
            "the router never marked the dead worker down"
        )
        time.sleep(0.2)
    marked_down = time.time() - killed
    recovered = [
        greedy(router.url, f"Recovered {i}: another question", 64) for i in range(6)
    ]
    for code, meta in inflight + after + recovered:
        if code == 200:
            assert (
                meta["completion_tokens"] in (n, 64)
                and meta["kara"]["compressions"] > 0
            ), meta
        else:
            assert code >= 500, (
                code,
                meta,
            )  # an explicit error, never a hang or a silent short answer
    assert all(code == 200 for code, _ in recovered), recovered
    survivor_stats = kara_stats(survivor)
    ok = sum(code == 200 for code, _ in inflight)
    figures = {
        "inflight": len(inflight),
        "inflight_ok": ok,
        "inflight_errors": sorted(
            {str(meta)[:120] for code, meta in inflight if code != 200}
        ),
        "sent_after_kill": len(after),
        "after_ok": sum(code == 200 for code, _ in after),
        "marked_down_s": round(marked_down, 1),
        "recovered_ok": sum(code == 200 for code, _ in recovered),
        "survivor_events": survivor_stats["events"],
    }
    print("\nROUTER kill: " + json.dumps(figures, sort_keys=True), flush=True)
    # the survivor kept serving: its in-flight requests (at least one, cache-aware spreads them) completed
    assert ok >= 1 and survivor_stats["events"] > 0
