"""Full-KV exact-answer accuracy of a proxy model with Hugging Face greedy generation (KV cache).

    nice -n 19 env OMP_WAIT_POLICY=PASSIVE python -m bench.quality.eval_hf \
        --model bench/models/reasoning_proxy --n 500

Held-out problems come from their own seed (default 20260611, never a training seed: training
draws from random.Random(--seed) with small seeds and its periodic eval from 10000019). Sizes are
uniform in [--size-min, --size-max] values (default 21..62 -> 313-969 generated tokens).
Prints accuracy with a 95% Wilson interval, a per-size breakdown, and optionally writes one JSON
line per problem (--jsonl) for paired comparisons with compressed-KV runs, with the run record
beside it (``<name>.run.json``, bench/record.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from bench.quality.task import check, extract_answer, make_problem  # noqa: E402
from bench.reasoning.stats import wilson  # noqa: E402

DEFAULT_SEED = 20260611


def held_out_problems(
    n: int, seed: int = DEFAULT_SEED, size_min: int = 21, size_max: int = 62
):
    rng = random.Random(seed)
    return [make_problem(rng, rng.randint(size_min, size_max)) for _ in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--size-min", type=int, default=21)
    ap.add_argument("--size-max", type=int, default=62)
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jsonl", default=None, help="write per-problem results here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    problems = held_out_problems(args.n, args.seed, args.size_min, args.size_max)
    # Sort by length so a batch holds similar lengths (less padding, fewer wasted decode steps).
    order = sorted(range(len(problems)), key=lambda i: len(problems[i][1].split()))
    results = [None] * len(problems)
    t0 = time.time()
    with torch.no_grad():
        for b in range(0, len(order), args.batch_size):
            idx = order[b : b + args.batch_size]
            enc = tok([problems[i][0] for i in idx], return_tensors="pt", padding=True)
            max_new = max(len(problems[i][1].split()) for i in idx) + 64
            out = model.generate(
                **enc,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            for i, row in zip(idx, out[:, enc["input_ids"].shape[1] :]):
                text = tok.decode(row, skip_special_tokens=True)
                prompt, solution, answer = problems[i]
                results[i] = {
                    "i": i,
                    "size": solution.count(" := "),
                    "answer": answer,
                    "pred": extract_answer(text),
                    "ok": check(text, answer),
                    "solution_tokens": len(solution.split()),
                    "output_tokens": len(text.split()),
                    "output_exact": text.strip() == solution,
                }
            done = b + len(idx)
            k = sum(r["ok"] for r in results if r)
            print(
                f"{done}/{len(problems)} correct {k} ({time.time() - t0:.0f}s)",
                flush=True,
            )

    k = sum(r["ok"] for r in results)
    lo, hi = wilson(k, len(results))
    exact_text = sum(r["output_exact"] for r in results)
    print(
        f"model {args.model}: exact answers {k}/{len(results)} = {k / len(results):.3f} "
        f"(95% Wilson CI {lo:.3f}-{hi:.3f}); whole solution verbatim {exact_text}/{len(results)}; "
        f"mean solution tokens {sum(r['solution_tokens'] for r in results) / len(results):.0f}; "
        f"{time.time() - t0:.0f}s"
    )
    buckets = {}
    for r in results:
        b = (r["size"] - args.size_min) // 7
        buckets.setdefault(b, []).append(r)
    for b in sorted(buckets):
        rs = buckets[b]
        sizes = [r["size"] for r in rs]
        toks = [r["solution_tokens"] for r in rs]
        print(
            f"  sizes {min(sizes)}-{max(sizes)} (solution {min(toks)}-{max(toks)} tokens): "
            f"{sum(r['ok'] for r in rs)}/{len(rs)}"
        )
    if args.jsonl:
        from bench.record import RunRecord

        record = RunRecord.beside(args.jsonl, argv)
        record.note(
            model=args.model,
            n=args.n,
            seed=args.seed,
            accuracy=sum(r["ok"] for r in results) / len(results),
        )
        with open(args.jsonl, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
        record.finish()


if __name__ == "__main__":
    main()
