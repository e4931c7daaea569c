"""The CPU serving kit: what makes a server run well on a CPU, beside the compression core (which
never imports it). Registered by the plugin only in a process without CUDA, or where
``KARA_CPU_KERNELS=1`` asks for the kernels (hooks.py):

    hooks.py      RoPE's CPU path, the CPU kernels' hooks and their report, the launcher's fork
    attention.py  torch_native decode and the recompute pass's window-only extend
    linear.py     float32 weights packed in place for oneDNN matmuls
    server.py     CPU server defaults, the RAM check, cores per scheduler rank
    memory.py     CPU memory sizing (request limit, KV pool)
    cores.py      SGLANG_CPU_OMP_THREADS_BIND for several ranks
    threads.py    OpenMP's wait policy, set before torch loads
    smollm2.py    the default model, converted once from its PyPI package
    _sglang.py    every SGLang internal the kit touches

Importing the package imports nothing (threads.py runs before torch loads)."""
