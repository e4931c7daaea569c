"""Every benchmark module imports cleanly and says what it measures: a name moved inside sgl_kara
(e.g. a helper that went from config.py to a policy file) must break this test, not a 25-minute
analysis run later. Modules are imported by name, as ``python -m bench.<name>`` runs them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from support import policy_registry_restored

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[1] / "bench"
FILES = sorted(
    p for p in BENCH.rglob("*.py") if "results" not in p.relative_to(BENCH).parts
)
MODULES = [
    ".".join(("bench", *p.relative_to(BENCH).with_suffix("").parts)).removesuffix(
        ".__init__"
    )
    for p in FILES
    if p.name != "__main__.py"
]


def test_every_benchmark_file_lies_in_the_package():
    """No script beside the package: every folder under bench/ holding Python is a package, so
    every file runs as ``python -m bench.<name>`` and imports its neighbours by their names."""
    loose = [
        str(p.relative_to(BENCH))
        for p in FILES
        if not (p.parent / "__init__.py").exists()
    ]
    assert not loose, loose
    assert {
        "bench.throughput",
        "bench.throughput_grid",
        "bench.engine_run",
        "bench.record",
        "bench.quality.harness",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name):
    with policy_registry_restored():  # a policy under trial registers on import
        module = importlib.import_module(name)  # top-level imports run; main() does not
    assert module.__doc__, f"{name} has no module docstring saying what it measures"
