"""H2O's decode observer: host cost per decode step, the batched observer (policies/h2o.py) vs
the loop over requests it replaced, at 256 running requests, on CPU.

    OMP_WAIT_POLICY=PASSIVE python -m bench.h2o_observer          # 256 requests x 32 layers, rows 64..192
    OMP_WAIT_POLICY=PASSIVE python -m bench.h2o_observer --requests 64 --out /tmp/h2o_observer.json

Both observers see the same decode steps (every request's row grows by one token per step, each
layer gets fresh queries) over one key pool; per step the script times every layer's observe
call (median over ``--steps`` steps after one warm-up step; ``--threads`` torch threads, 1 by
default: a shared 2-core machine), counts the operators of one step that would each launch a
kernel on a GPU (every ATen call seen by a dispatch mode, less views and allocations) and checks
that both leave the same accumulated attention (largest absolute difference). The ratio of the
two medians comes from one run, on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_kara.policies.base import ObserveInput
from sgl_kara.policies.h2o import H2OOptions, H2OPolicy
from sgl_kara.scheduler.state import KaraReqState


class LoopObserver:
    """The observer as it was: one softmax per request and layer, accumulators [H_kv, capacity]
    over whole rows (row position 0 on), grown to max(64, 2 x length)."""

    def __init__(self):
        self.acc: dict = {}

    def observe(self, inp: ObserveInput) -> None:
        hq, d = inp.queries.shape[1], inp.queries.shape[2]
        hkv = inp.k_buffer.shape[1]
        for i, (slots, state) in enumerate(zip(inp.row_slots, inp.rows)):
            if state is None or not state.enabled:
                continue
            keys = inp.k_buffer[slots]
            q = inp.queries[i].float().reshape(hkv, hq // hkv, d)
            probs = torch.softmax(
                torch.einsum("hgd,lhd->hgl", q, keys.float()) / math.sqrt(d), dim=-1
            ).sum(1)
            key = (id(state), inp.layer)
            acc = self.acc.get(key)
            if acc is None or acc.shape[1] < slots.numel():
                grown = torch.zeros(
                    hkv, max(64, 2 * slots.numel()), dtype=torch.float32
                )
                if acc is not None:
                    grown[:, : acc.shape[1]] = acc
                self.acc[key] = acc = grown
            acc[:, : slots.numel()] += probs


class OpCount(TorchDispatchMode):
    """ATen calls that compute (a kernel launch each on a GPU; a foreach call counts once, as its
    fused launch does): views and allocations left out."""

    SKIP = {"empty", "empty_like", "empty_strided", "zeros_like", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in self.SKIP:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def decode_steps(args, seed: int = 0):
    """Per step: (row slots per request, [queries per layer])."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(
        args.min_len, args.max_len + 1, (args.requests,), generator=g
    ).tolist()
    span = args.max_len + args.steps + 2
    for step in range(args.steps + 1):
        rows = [
            torch.arange(i * span, i * span + n + step, dtype=torch.int64)
            for i, n in enumerate(lengths)
        ]
        queries = [
            torch.randn(args.requests, args.q_heads, args.head_dim, generator=g)
            for _ in range(args.layers)
        ]
        yield rows, queries


def run(observer, states, args, k_buffer) -> dict:
    times, ops = [], None
    for step, (rows, queries) in enumerate(decode_steps(args)):
        if step == 1:  # counted, not timed
            with OpCount() as count:
                for layer in range(args.layers):
                    observer.observe(
                        ObserveInput(layer, queries[layer], k_buffer, rows, states)
                    )
            ops = count.ops
            continue
        tic = time.perf_counter()
        for layer in range(args.layers):
            observer.observe(
                ObserveInput(layer, queries[layer], k_buffer, rows, states)
            )
        if step > 1:
            times.append(time.perf_counter() - tic)  # step 0 warms up
    return {
        "median_ms": 1e3 * statistics.median(times),
        "steps_timed": len(times),
        "ops_per_step": ops,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed steps (after one warm-up and one counted)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.steps += 1  # the counted step
    g = torch.Generator().manual_seed(1)
    span = args.max_len + args.steps + 2
    k_buffer = torch.randn(
        args.requests * span, args.kv_heads, args.head_dim, generator=g
    )
    loop_states = [KaraReqState() for _ in range(args.requests)]
    new_states = [KaraReqState() for _ in range(args.requests)]
    loop = LoopObserver()
    policy = H2OPolicy(H2OOptions())
    old = run(loop, loop_states, args, k_buffer)
    new = run(policy, new_states, args, k_buffer)
    err = 0.0
    for ls, ns in zip(loop_states, new_states):
        base = ns.policy_state["h2o_base"]
        for layer, acc in ns.policy_state["h2o"].items():
            want = loop.acc[(id(ls), layer)]
            n = min(acc.shape[0], want.shape[1] - base)
            err = max(err, float((acc[:n].T - want[:, base : base + n]).abs().max()))
    out = {
        "requests": args.requests,
        "layers": args.layers,
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "rows": [args.min_len, args.max_len],
        "loop": old,
        "batched": new,
        "ratio": old["median_ms"] / new["median_ms"],
        "max_abs_diff": err,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.node(),
        "command": " ".join(sys.argv),
    }
    print(
        f"{args.requests} requests x {args.layers} layers, rows {args.min_len}..{args.max_len} (+{args.steps} steps), "
        f"H_q {args.q_heads}, H_kv {args.kv_heads}, D {args.head_dim}, {torch.get_num_threads()} threads"
    )
    print(
        "| observer | ms per decode step (median) | operators per step (GPU launches) |"
    )
    print("|---|---|---|")
    print(f"| loop over requests | {old['median_ms']:.1f} | {old['ops_per_step']} |")
    print(f"| batched | {new['median_ms']:.1f} | {new['ops_per_step']} |")
    print(
        f"ratio loop / batched: {out['ratio']:.1f}x; largest accumulator difference {err:.2e}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
