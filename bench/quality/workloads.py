"""Teacher-forced workloads of ``python -m bench.quality --real``: natural text and recall.

``--text SOURCE``: a text's first 64 tokens are the prompt and its next ``--new-tokens`` tokens
are forced through the engine as "generated" ones (full KV records its distributions on them;
every policy is compared with full KV at each step; PPL is the text's). SOURCE:

    python   Python standard-library modules (``PYTHON_FILES`` of the running interpreter)
    prose    English license texts (``PROSE_FILES``, /usr/share/common-licenses)
    a path   a file, a directory (its files, sorted) or a glob

Texts shorter than 64 + ``--new-tokens`` tokens are skipped; ``--n`` texts are taken in order.

``--recall``: a generated text that states ``--facts`` facts (the 4-digit codes of named people),
runs on with unrelated prose (license text) until the facts are repeated in another order at
the end of its ``--new-tokens`` tokens (so they lie ~``--new-tokens`` back, far beyond a window). Scored on the recall values only:
accuracy of the greedy choice (hit: equals the stated value), agreement with full KV, KL and PPL
on those tokens; the other steps are forced and scored as the text columns.

No SGLang import; needs the model's tokenizer.
"""

from __future__ import annotations

import glob
import math
import os
import random
import sysconfig

import numpy as np

PROMPT_TOKENS = 64
PYTHON_FILES = (
    "argparse.py typing.py dataclasses.py inspect.py subprocess.py "
    "tarfile.py pathlib.py functools.py enum.py ast.py difflib.py "
    "threading.py zipfile.py shutil.py pickle.py logging/__init__.py"
).split()
LICENSES = "/usr/share/common-licenses"
PROSE_FILES = "GPL-3 LGPL-2.1 GFDL-1.3 MPL-1.1 GPL-2 LGPL-2 GFDL-1.2 Apache-2.0".split()
NAMES = (
    "Alice Bruno Chen Dana Emeka Farah Goran Hana Ivan Jun Kofi Lena Mateo "
    "Nadia Omar Priya Quinn Rosa Sven Tariq"
).split()


def source_files(source: str) -> list[str]:
    if source == "python":
        stdlib = sysconfig.get_paths()["stdlib"]
        return [os.path.join(stdlib, f) for f in PYTHON_FILES]
    if source == "prose":
        return [os.path.join(LICENSES, f) for f in PROSE_FILES]
    if os.path.isdir(source):
        return sorted(
            p for p in glob.glob(os.path.join(source, "*")) if os.path.isfile(p)
        )
    found = sorted(glob.glob(source))
    if not found:
        raise SystemExit(
            f"--text {source!r}: not python, prose, a file, a directory or a glob that matches"
        )
    return found


def text_problems(source: str, n: int, new_tokens: int, tok) -> list[dict]:
    """[{"id", "input_ids" (64 tokens), "target" (new_tokens tokens)}] from SOURCE's texts."""
    out = []
    for path in source_files(source):
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tok(f.read(), add_special_tokens=False)["input_ids"]
        if len(ids) < PROMPT_TOKENS + new_tokens:
            continue
        out.append(
            dict(
                id=os.path.basename(path),
                input_ids=ids[:PROMPT_TOKENS],
                target=ids[PROMPT_TOKENS : PROMPT_TOKENS + new_tokens],
            )
        )
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(
            f"--text {source}: only {len(out)} texts of >= {PROMPT_TOKENS + new_tokens} tokens (asked {n})"
        )
    return out


def recall_problems(
    n: int, new_tokens: int, facts: int, tok, seed: int = 0
) -> list[dict]:
    """Recall items of exactly ``new_tokens`` forced tokens: facts, prose, the facts again;
    ``score_steps`` are the forced steps of the recalled values (each code's non-blank tokens)."""

    def ids_of(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    prose = []
    # license texts; Python where absent
    for path in source_files("prose") + source_files("python"):
        if os.path.exists(path) and len(prose) < 4 * new_tokens:
            with open(path, encoding="utf-8", errors="replace") as f:
                prose += ids_of(f.read())
    if len(prose) < new_tokens:
        prose = prose * math.ceil(new_tokens / max(1, len(prose)))
    prompt = ids_of(
        "The following notes list the access code of each member of the team. Read them carefully: "
        "at the end, every code is written down again from memory.\n\n"
    )
    out = []
    for i in range(n):
        rng = random.Random(seed * 1000 + i)
        names = rng.sample(NAMES, facts)
        codes = {name: str(rng.randrange(1000, 10000)) for name in names}

        # (tokens, the value's offsets): stated and recalled with the same tokens
        def fact(name, codes=codes):
            before = ids_of(f"The access code of {name} is")
            value = ids_of(f" {codes[name]}")
            ids = before + value + ids_of(".\n")
            return ids, [
                len(before) + j for j, t in enumerate(value) if tok.decode([t]).strip()
            ]

        head = [t for name in names for t in fact(name)[0]]
        tail, steps = ids_of("\nNow, from memory, the codes again:\n"), []
        order = names[:]
        rng.shuffle(order)
        for name in order:
            ids, value = fact(name)
            steps += [len(tail) + v for v in value]
            tail += ids
        room = new_tokens - len(head) - len(tail)
        if room < 1:
            raise SystemExit(
                f"--recall: {facts} facts need more than --new-tokens {new_tokens} tokens"
            )
        off = rng.randrange(0, len(prose) - room + 1)
        middle = prose[off : off + room]
        target = head + middle + tail
        base = len(head) + len(middle)
        scored = [base + s for s in steps]
        row = dict(id=f"recall-{i}", input_ids=prompt, target=target)
        out.append(dict(row, score_steps=scored, distance=len(middle)))
    return out


def full_kv_row(directory: str, problems: list[dict]) -> dict:
    """Full KV's own row from its record: agreement 1 and KL 0 by definition, the text's PPL and
    hit rate (greedy choice = the text's token), on every step and on the scored steps."""
    from bench.quality.fidelity import ref_path

    nll, hit, s_nll, s_hit = [], [], [], []
    for k, p in enumerate(problems):
        target = np.asarray(p["target"])
        rows = np.memmap(ref_path(directory, k), dtype=np.float32, mode="r").reshape(
            len(target), -1
        )
        lp = rows[np.arange(len(target)), target]
        h = rows.argmax(axis=1) == target
        nll += (-lp).tolist()
        hit += h.tolist()
        for t in p.get("score_steps", ()):
            s_nll.append(float(-lp[t]))
            s_hit.append(bool(h[t]))
    row = dict(policy="none", ratio=None, agree=1.0, kl=0.0)
    row.update(ppl=math.exp(sum(nll) / len(nll)), hit=sum(hit) / len(hit))
    row.update(n=len(problems), tokens=len(nll))
    if s_nll:
        row.update(
            agree_scored=1.0,
            kl_scored=0.0,
            ppl_scored=math.exp(sum(s_nll) / len(s_nll)),
            hit_scored=sum(s_hit) / len(s_hit),
            scored_tokens=len(s_nll),
        )
    return row


def scored_stats(steps_by_k: dict, problems: list[dict]) -> dict:
    """Policy stats on every step's hit rate and on the scored (recall) steps only."""
    hit = [h for st in steps_by_k.values() for h in st.get("hit", [])]
    out = dict(hit=sum(hit) / len(hit)) if hit else {}
    pick = [(st, problems[k].get("score_steps", ())) for k, st in steps_by_k.items()]
    if any(s for _, s in pick):
        a = [st["agree"][t] for st, s in pick for t in s]
        kl = [st["kl"][t] for st, s in pick for t in s]
        nll = [st["nll"][t] for st, s in pick for t in s]
        h = [st["hit"][t] for st, s in pick for t in s]
        out.update(
            agree_scored=sum(a) / len(a),
            kl_scored=sum(kl) / len(kl),
            ppl_scored=math.exp(sum(nll) / len(nll)),
            hit_scored=sum(h) / len(h),
            scored_tokens=len(a),
        )
    return out
