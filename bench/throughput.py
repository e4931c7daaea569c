"""Throughput under a memory-constrained KV pool, vanilla SGLang against sgl_kara:
``python -m bench.throughput --grid ...`` runs the workload grid of bench/throughput_grid.py
(``--help`` lists its options).

    python -m bench.throughput --grid --model tiny --out DIR
"""

from bench.throughput_grid import main

if __name__ == "__main__":
    main()
