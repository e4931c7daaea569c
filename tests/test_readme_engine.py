"""README's Python example (Quick start), saved to a file as written and run as a script: it starts
``sgl_kara.Engine`` on the default model, its 700-token answer (greedy, EOS ignored: the length does
not depend on sampling) is compressed once (W 512, due every 128 of its tokens: at token 640), it
prints ``meta_info["kara"]`` and exits 0. Integration tier (an engine of its own on SmolLM2, ~2.5 min
on the 2-core VM); the check that the example fixes its length runs in the default suite."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_engine_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if "sgl_kara.Engine(" in b]
    assert len(found) == 1, (
        f"README should hold one Python block that starts sgl_kara.Engine, found {len(found)}"
    )
    return found[0]


def test_readme_python_example_fixes_its_answer_length():
    """SGLang samples at temperature 1 unless told: an example whose compression count depends on where
    a sampled story ends would print ``compressions 0`` on some runs."""
    block = readme_engine_example()
    params = ast.literal_eval(
        re.search(r"engine\.generate\([^,]+,\s*(\{.*?\})\)", block).group(1)
    )
    assert params["temperature"] == 0 and params["ignore_eos"] is True, params
    assert params["max_new_tokens"] > 640, (
        params
    )  # past the first due step of window 512, period 128


@pytest.mark.integration
def test_readme_python_example_runs_as_a_script(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(readme_engine_example())
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "KARA_SERVE")
    }
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    kara = ast.literal_eval(
        proc.stdout.strip().splitlines()[-1]
    )  # print(out["meta_info"]["kara"])
    assert kara["enabled"] is True and kara["compressions"] == 1
    assert (
        kara["kv_logical_len"] > 700
        and kara["kv_physical_len"] < kara["kv_logical_len"] - 200
    )
