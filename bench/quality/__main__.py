"""``python -m bench.quality``: the quality harness (bench/quality/harness.py), run as that module
(not as this package's ``__main__``), so that the engine processes SGLang starts by spawn import it
again -- and with it the policies of any ``--policy-file`` (bench/reasoning/configs.py)."""

import runpy

runpy.run_module("bench.quality.harness", run_name="__main__", alter_sys=True)
