"""Fidelity to full KV: next-token agreement and KL when the full-KV output is fed through a policy.

Accuracy saturates (or collapses) and hides how far a policy's distribution moved; fidelity does
not. Two passes through ``sgl_kara.Engine`` with one custom logit processor (engine flag
``enable_custom_logit_processor=True``), run in the scheduler process:

1. ``record`` (full KV): greedy generation; at every sampling step t the processor appends the
   step's log-probabilities (float32, [V]) to ``<dir>/ref_<k>.f32``. With ``tokens`` (teacher-
   forced text) it also emits ``tokens[t]``, so the record is of that text, not a generation.
2. ``force`` (a policy): the request is fed the full-KV output ``tokens``. At step t the processor
   takes the policy's log-probabilities, counts agreement ``argmax == argmax of row t`` (the
   full-KV greedy choice; for a greedy full-KV output that is ``tokens[t]``), ``KL(p_full ||
   p_policy)`` against row t of ``ref_<k>.f32``, the policy's negative log-likelihood of
   ``tokens[t]`` and whether its greedy choice is ``tokens[t]`` (hit), then masks the logits so ``tokens[t]`` is emitted and the prefix stays the full-KV
   one. When the last token is emitted, the per-step results go to ``<dir>/<tag>_<k>.json``.

The step index is ``len(req.output_ids)`` (needs the overlap scheduler off, as bench/quality/harness.py
runs). Both functions below are pure torch; the processor class is a thin wrapper so it can be
checked without an engine.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

try:
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
except ImportError:  # pragma: no cover - the pure functions still import without sglang
    CustomLogitProcessor = object

KEY = "fidelity"

_REFS: dict[str, np.ndarray] = {}  # ref file -> memmap [steps, V] (scheduler process)
_STEPS: dict[
    tuple[str, int], list[tuple[int, float, float, int]]
] = {}  # (tag, k) -> [(agree, kl, nll, hit)]


def step_stats(
    logits: torch.Tensor, ref_logp: torch.Tensor, token: int
) -> tuple[int, float, float, int]:
    """(agree, KL(p_ref || p), -log p(token), hit) for one step. logits, ref_logp: [V]; ref_logp
    is renormalised; agree: the policy's greedy choice is the reference's; hit: it is ``token``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref = ref_logp.float() - torch.logsumexp(ref_logp.float(), dim=-1)
    # Tokens masked in both runs (-inf, e.g. EOS under min_new_tokens) contribute 0, not nan.
    kl = (
        torch.where(
            torch.isfinite(ref), ref.exp() * (ref - logp), torch.zeros_like(ref)
        )
        .sum()
        .clamp_min(0.0)
    )
    choice = int(torch.argmax(logp))
    return (
        int(choice == int(torch.argmax(ref))),
        float(kl),
        float(-logp[token]),
        int(choice == token),
    )


def force(logits: torch.Tensor, token: int) -> torch.Tensor:
    """Logits [V] whose greedy choice is ``token``: -inf everywhere else."""
    out = torch.full_like(logits, float("-inf"))
    out[token] = 0.0
    return out


def ref_path(directory: str, k: int) -> str:
    return os.path.join(directory, f"ref_{k}.f32")


def stats_path(directory: str, tag: str, k: int) -> str:
    return os.path.join(directory, f"{tag}_{k}.json")


def _ref_rows(path: str, vocab: int) -> np.ndarray:
    rows = _REFS.get(path)
    if rows is None:
        rows = _REFS[path] = np.memmap(path, dtype=np.float32, mode="r").reshape(
            -1, vocab
        )
    return rows


class FidelityProcessor(CustomLogitProcessor):
    """custom_params["fidelity"] = {"mode": "record"|"force", "dir", "k", "tag", "tokens"}."""

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list or []):
            p = (params or {}).get(KEY)
            if p is None:
                continue
            step = len(params["__req__"].output_ids)
            if p["mode"] == "record":
                path = ref_path(p["dir"], p["k"])
                row = torch.log_softmax(logits[i].float(), dim=-1).cpu().numpy()
                size = os.path.getsize(path) if os.path.exists(path) else 0
                if size != step * row.nbytes:
                    raise RuntimeError(
                        f"fidelity record {path}: step {step} but the file holds {size // row.nbytes} rows"
                    )
                with open(path, "ab") as f:
                    f.write(row.tobytes())
                # teacher-forced text: full KV reads the text, not its own output
                if "tokens" in p:
                    logits[i] = force(logits[i], p["tokens"][step])
                continue
            tokens, key = p["tokens"], (p["tag"], p["k"])
            if step >= len(tokens):
                raise RuntimeError(
                    f"fidelity force {key}: step {step} beyond the {len(tokens)} full-KV tokens"
                )
            ref = _ref_rows(ref_path(p["dir"], p["k"]), logits.shape[-1])
            if step >= ref.shape[0]:
                raise RuntimeError(
                    f"fidelity force {key}: ref_{p['k']} has {ref.shape[0]} rows, step {step}"
                )
            per_step = _STEPS.setdefault(key, [])
            if len(per_step) != step:
                raise RuntimeError(
                    f"fidelity force {key}: step {step} after {len(per_step)} recorded steps"
                )
            per_step.append(
                step_stats(
                    logits[i], torch.from_numpy(np.array(ref[step])), tokens[step]
                )
            )
            logits[i] = force(logits[i], tokens[step])
            if step == len(tokens) - 1:
                with open(stats_path(p["dir"], p["tag"], p["k"]), "w") as f:
                    json.dump(
                        {
                            "agree": [a for a, _, _, _ in per_step],
                            "kl": [round(x, 6) for _, x, _, _ in per_step],
                            "nll": [round(x, 5) for _, _, x, _ in per_step],
                            "hit": [h for *_, h in per_step],
                        },
                        f,
                    )
                del _STEPS[key]
        return logits


def load_steps(directory: str, tag: str, k: int) -> dict:
    """One problem's per-step {"agree", "kl", "nll", "hit"} lists."""
    with open(stats_path(directory, tag, k)) as f:
        return json.load(f)


def summarize(
    directory: str, tag: str, ks: list[int], roles: dict[int, list[str]] | None = None
) -> dict:
    """Token-weighted agreement and mean KL over problems ks (one read of each stats file); with
    ``roles`` (problem k -> per-step role: the proxy's task.token_roles of the full-KV output;
    steps past them, e.g. EOS, are ``eos``) also ``disagree_by_role`` = {role: [disagreeing
    steps, steps]}. Raises if any problem is missing."""
    agree, kl, missing = [], [], []
    by_role: dict[str, list[int]] = {}
    for k in ks:
        path = stats_path(directory, tag, k)
        if not os.path.exists(path):
            missing.append(k)
            continue
        d = json.load(open(path))
        agree += d["agree"]
        kl += d["kl"]
        for t, a in enumerate(d["agree"] if roles else ()):
            cell = by_role.setdefault(
                roles[k][t] if t < len(roles[k]) else "eos", [0, 0]
            )
            cell[0] += 1 - a
            cell[1] += 1
    if missing:
        raise RuntimeError(
            f"fidelity {tag}: no stats for problems {missing[:10]} (forced run ended early?)"
        )
    out = dict(
        agree=sum(agree) / len(agree),
        kl=sum(kl) / len(kl),
        fid_n=len(ks),
        fid_tokens=len(agree),
    )
    if roles:
        out["disagree_by_role"] = by_role
    return out
