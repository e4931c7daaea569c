"""Every benchmark script imports cleanly: a name moved inside sgl_kara (e.g. a helper that went
from config.py to a policy file) must break this test, not a 25-minute analysis run later
(event_analysis.py once still imported default_chunk_budget from sgl_kara.config)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in [*BENCH.glob("*.py"), *(BENCH / "quality").glob("*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_bench_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.syspath_prepend(str(BENCH))
    name = f"_bench_import_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)  # top-level imports run; main() does not (__name__ differs)
    assert module.__doc__, f"{path.name} has no module docstring saying what it measures"
