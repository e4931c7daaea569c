"""Benchmarks of sgl_kara: every figure of bench/RESULTS.md and its family files, one module each.

Run from the repository root as modules, ``python -m bench.<name> --help`` (docs/BENCHMARKS.md
lists the command behind each figure). Every script that writes results takes ``--out`` and
stores its run record beside them (bench/record.py: date, machine, commit, command, the resolved
``KaraConfig`` and SGLang settings of every engine, the CPU kernel switches).

    throughput, throughput_grid   vanilla SGLang vs sgl_kara across a grid of workloads
    engine_run, step_costs        one engine on one workload; per-step costs from its trace
    serve_numbers                 the default server: start-up, memory, decode
    gpu_kernels, gpu_suite        the device check, the GPU suite
    scoring_cost                  the GPU roofline of Kara's scoring schedules
    quality/                      what compression costs in answers (python -m bench.quality)
"""
