"""``python -m bench.quality``: the quality harness (bench/quality/harness.py)."""

from bench.quality.harness import main

main()
