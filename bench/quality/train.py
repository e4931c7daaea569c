"""Train the reasoning proxy: a small Llama on the pointer-chain task (task.py), on CPU.

Three stages (the committed proxy, bench/models/reasoning_proxy, came from exactly these, ~95 min in all on
one core; log in bench/quality/train_log.txt):

    # stage 1: curriculum from size 6 to 64, fresh init, task format 2 (~58 min)
    env OMP_WAIT_POLICY=PASSIVE python -m bench.quality.train --task-format 2 \
        --out /tmp/proxy_stage1 --steps 1200 --seed 0 --log bench/quality/train_log.txt
    # stage 2: all sizes, the stop/continue decision after each step weighted 20x (~16 min)
    env OMP_WAIT_POLICY=PASSIVE python -m bench.quality.train --task-format 2 --init-from /tmp/proxy_stage1 \
        --out /tmp/proxy_stage2 --steps 300 --seed 1 --lr 3e-4 --warmup 10 \
        --size-start 64 --decide-weight 20 --eval-every 100 --log bench/quality/train_log.txt
    # stage 3: task format 3 (the last pointer is an L word), vocabulary grown by the 640 Lk=d
    # words (initialised from Pk=d), stop word 3x on top (~21 min)
    env OMP_WAIT_POLICY=PASSIVE python -m bench.quality.train --init-from /tmp/proxy_stage2 \
        --out bench/models/reasoning_proxy --steps 400 --seed 2 --lr 3e-4 --warmup 10 \
        --size-start 64 --decide-weight 20 --stop-weight 3 --eval-every 100 --log bench/quality/train_log.txt

Stages 1-2 compute every value of the chain but often fail
to stop after the last step: in format 2 that needs comparing the current name with the queried
one, which the model never learned reliably (1 problem in 3 lost; weighting the stop word only
moved the threshold). Format 3 makes the stop a one-hop recall (task.py), and stage 3 learns it
in a few hundred steps.

Deterministic from --seed (one thread, seeded data stream, seeded init). Loss only on solution
tokens (+ EOS). Curriculum: the largest problem size grows linearly from --size-start to
--size-max over the first --ramp fraction of steps; each batch draws a size band below the
current maximum and fills a fixed token budget, so short problems come in large batches. AdamW
with linear warm-up and cosine decay. Every --eval-every steps it logs greedy exact-answer
accuracy on a small held-out set (different seed) and saves the model, tokenizer and config to
--out (config.json, model.safetensors, generation_config.json, tokenizer files).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from bench.quality.task import (  # noqa: E402
    FORMAT,
    FORMATS,
    MAX_NAMES,
    ROLES,
    check,
    make_problem,
    parse_word,
    token_roles,
    vocabulary,
)
from bench.quality.tokenizer import build_tokenizer  # noqa: E402

DECIDE = ROLES.index("decide")
# held-out problems (train.py's periodic eval); the quality harness uses its own (--seed)
EVAL_SEED = 10_000_019


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init-from",
        default=None,
        help="continue from this checkpoint's weights (stage 2) instead of a fresh init",
    )
    p.add_argument(
        "--decide-weight",
        type=float,
        default=1.0,
        help="loss weight of 'decide' words (continue with the next step or answer)",
    )
    p.add_argument(
        "--stop-weight",
        type=float,
        default=1.0,
        help="extra loss factor on the one 'stop' decision per problem (the 'answer' word)",
    )
    p.add_argument(
        "--task-format",
        type=int,
        default=FORMAT,
        choices=FORMATS,
        help="task format (task.make_problem); stages 1-2 of the committed model used 2",
    )
    p.add_argument("--log", default=None, help="log file (default: <out>/train.log)")
    p.add_argument("--threads", type=int, default=1)
    # model
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    # optimisation
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=6144,
        help="token budget per batch (incl. prompt)",
    )
    # curriculum (size = number of values in the chain; 16 solution tokens per step)
    p.add_argument("--size-start", type=int, default=6)
    p.add_argument("--size-max", type=int, default=64)
    p.add_argument(
        "--ramp",
        type=float,
        default=0.5,
        help="fraction of steps over which the max size grows",
    )
    p.add_argument(
        "--band", type=int, default=4, help="sizes in one batch span [h-band+1, h]"
    )
    # logging / eval
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=16)
    return p.parse_args(argv)


def model_config(args, vocab_size: int, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )


@torch.no_grad()
def structured_init(model, tok, seed: int):
    """Give every name word a shared per-name direction (and compounds their digit's direction).

    Word ``Fk`` (family F, name k) gets (n_k + f_F) / sqrt(2) and ``Fk=d`` gets
    (n_k + f_F + e_d) / sqrt(3), in both the input embedding and the output head, where n_k and
    f_F are fresh random vectors and e_d is digit d's own (random) row. Training starts from
    words that already share "which name" and "which digit" features, so the one-hop recalls
    (``rk`` -> ``Vk=d``, ``Kk`` -> ``Pk=δ``) and writing ``Vk=d`` from its name and digit are
    learnable from the first steps. Everything stays trainable.
    """
    g = torch.Generator().manual_seed(seed + 1)
    for weight in (
        model.get_input_embeddings().weight,
        model.get_output_embeddings().weight,
    ):
        std = (
            weight[tok.convert_tokens_to_ids([str(d) for d in range(10)])].std().item()
        )
        names = torch.randn(MAX_NAMES, weight.shape[1], generator=g) * std
        fams = {}
        for word, idx in tok.get_vocab().items():
            parsed = parse_word(word)
            if parsed is None:
                continue
            fam, k, d = parsed
            if fam not in fams:
                fams[fam] = torch.randn(weight.shape[1], generator=g) * std
            parts = [names[k], fams[fam]]
            if d is not None:
                parts.append(weight[tok.convert_tokens_to_ids(str(d))])
            weight[idx] = sum(parts) / len(parts) ** 0.5


@torch.no_grad()
def grow_vocab(model, tok, seed: int) -> int:
    """Resize a model trained on a smaller vocabulary (format 2: no ``Lk=d`` words) to ``tok``.

    Each new compound word ``Lk=d`` starts as its ``Pk=d`` row plus one shared random "family L"
    direction (as structured_init builds families), in the input embedding and the output head,
    so the model begins by reading an L pointer as the pointer it already knows. Returns the
    number of rows added."""
    old = model.get_input_embeddings().weight.shape[0]
    if old >= len(tok):
        return 0
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    g = torch.Generator().manual_seed(seed + 2)
    vocab = tok.get_vocab()
    for weight in (
        model.get_input_embeddings().weight,
        model.get_output_embeddings().weight,
    ):
        fam = torch.randn(weight.shape[1], generator=g) * weight[:old].std().item()
        for word, idx in vocab.items():
            if idx >= old:
                parsed = parse_word(word)
                if parsed is None or parsed[0] != "L":
                    raise ValueError(f"new word {word!r} has no initialisation rule")
                weight[idx] = weight[vocab[f"P{parsed[1]}={parsed[2]}"]] + fam / 3**0.5
    return len(tok) - old


def max_size_at(step: int, args) -> int:
    frac = min(1.0, step / max(1, args.ramp * args.steps))
    return round(args.size_start + frac * (args.size_max - args.size_start))


def encode_example(tok, prompt: str, solution: str) -> tuple[list[int], int]:
    """(ids, n_prompt): <bos> prompt solution <eos>; loss on ids[n_prompt:]."""
    p = tok(prompt)["input_ids"]  # with <bos>
    s = tok(solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p + s, len(p)


def make_batch(rng: random.Random, tok, step: int, args):
    hi = max_size_at(step, args)
    h = rng.randint(3, hi)  # band top, uniform: each size gets a similar token share
    lo = max(3, h - args.band + 1)
    rows, starts, roles = [], [], []
    est = 17 * h + 10  # tokens per example at size h
    n = max(1, args.batch_tokens // est)
    for _ in range(n):
        prompt, solution, _ = make_problem(rng, rng.randint(lo, h), args.task_format)
        ids, n_prompt = encode_example(tok, prompt, solution)
        rows.append(ids)
        starts.append(n_prompt)
        roles.append(
            [ROLES.index(r) for r in token_roles(solution, fmt=args.task_format)] + [0]
        )  # + EOS
    T = max(len(r) for r in rows)
    x = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
    y = torch.full((len(rows), T), -100, dtype=torch.long)
    role = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (r, s0, ro) in enumerate(zip(rows, starts, roles)):
        x[i, : len(r)] = torch.tensor(r)
        y[i, s0 - 1 : len(r) - 1] = torch.tensor(
            r[s0:]
        )  # predict token t+1 at position t
        role[i, s0 - 1 : len(r) - 1] = torch.tensor(ro)
    return x, y, role, h


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (
        args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))
    )


@torch.no_grad()
def greedy_accuracy(model, tok, problems, batch_size: int = 12) -> float:
    """Exact-answer accuracy of greedy decoding (HF generate, KV cache, left padding)."""
    model.eval()
    tok.padding_side = "left"
    ok = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        enc = tok([p for p, _, _ in chunk], return_tensors="pt", padding=True)
        max_new = max(len(s.split()) for _, s, _ in chunk) + 40
        out = model.generate(
            **enc,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        for (_, _, ans), row in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            ok += check(tok.decode(row, skip_special_tokens=True), ans)
    model.train()
    return ok / len(problems)


def save(model, tok, out: Path, meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    (out / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    from transformers import GenerationConfig, LlamaForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else out / "train.log"
    log = open(log_path, "a")

    def emit(msg: str):
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    tok = build_tokenizer(
        vocabulary(args.task_format)
    )  # format 2: the stage-1/2 vocabulary
    stop_id = tok.convert_tokens_to_ids("answer")
    config = model_config(args, len(tok), tok)
    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(
            args.init_from, torch_dtype=torch.float32
        )
        grown = grow_vocab(model, tok, args.seed)
        if grown:
            emit(f"vocabulary grown by {grown} words (Lk=d pointers of the last step)")
    else:
        model = LlamaForCausalLM(config)
        structured_init(model, tok, args.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=2048,
    )
    n_params = sum(p.numel() for p in model.parameters())
    emit(f"start args={vars(args)} params={n_params}")

    decay = [
        p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n
    ]
    no_decay = [
        p
        for n, p in model.named_parameters()
        if not (p.dim() >= 2 and "embed" not in n)
    ]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    rng = random.Random(args.seed)
    eval_rng = random.Random(EVAL_SEED)
    model.train()
    t0 = time.time()
    acc_loss = acc_tok = acc_n = 0.0
    role_hits = torch.zeros(len(ROLES))
    role_count = torch.zeros(len(ROLES))
    for step in range(args.steps):
        x, y, role, h = make_batch(rng, tok, step, args)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        logits = model(input_ids=x).logits
        mask = y != -100
        per_token = torch.nn.functional.cross_entropy(
            logits[mask], y[mask], reduction="none"
        )
        decide = role[mask] == DECIDE
        weight = torch.where(decide, args.decide_weight, 1.0)
        weight = torch.where(
            decide & (y[mask] == stop_id), weight * args.stop_weight, weight
        )
        loss = (per_token * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            hit = (logits[mask].argmax(-1) == y[mask]).float()
            acc_tok += hit.mean().item()
            role_hits.index_add_(0, role[mask], hit)
            role_count.index_add_(0, role[mask], torch.ones_like(hit))
        acc_loss += loss.item()
        acc_n += 1
        if (step + 1) % args.log_every == 0:
            emit(
                f"step {step + 1} loss {acc_loss / acc_n:.4f} tok_acc {acc_tok / acc_n:.4f} "
                f"max_size {max_size_at(step, args)} lr {lr_at(step, args):.2e} "
                f"batch {tuple(x.shape)} elapsed {time.time() - t0:.0f}s | acc "
                + " ".join(
                    f"{r} {role_hits[i] / max(1.0, role_count[i].item()):.3f}"
                    for i, r in enumerate(ROLES)
                )
            )
            acc_loss = acc_tok = acc_n = 0.0
            role_hits.zero_()
            role_count.zero_()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            size_now = max_size_at(step, args)
            sizes = [min(MAX_NAMES, max(3, size_now - 4 * i)) for i in range(3)]
            probs = [
                make_problem(eval_rng, sizes[i % 3], args.task_format)
                for i in range(args.eval_n)
            ]
            te = time.time()
            acc = greedy_accuracy(model, tok, probs)
            emit(
                f"eval step {step + 1} sizes {sizes} exact {acc:.3f} ({round(acc * len(probs))}/{len(probs)}) "
                f"eval_time {time.time() - te:.0f}s"
            )
            save(
                model,
                tok,
                out,
                {
                    "args": vars(args),
                    "step": step + 1,
                    "params": n_params,
                    "train_seconds": round(time.time() - t0),
                    "last_eval": acc,
                },
            )
    emit(f"done steps {args.steps} elapsed {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
