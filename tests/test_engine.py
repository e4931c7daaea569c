"""sgl_kara.Engine with policy none against plain sglang.Engine (tiny Llama fixture): with the CPU
kernels off it is SGLang token for token (sgl_kara's serving hooks change nothing it computes);
with its default CPU kernels it is plain SGLang that opted into the same kernels
(``KARA_CPU_KERNELS=1``), token for token; out-of-vocabulary ids get a clear error. A script
that creates an Engine outside ``if __name__ == "__main__":`` is stopped at once with a message
saying so."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from support import start_engine

PROMPTS = [
    "Hello world",
    "The answer is",
    "Let x = 3. Let y = x + 4, so",
    "Once upon a time",
]
GREEDY = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}


def _generate(kind, model, kernels, **kwargs):
    saved = os.environ.get("KARA_CPU_KERNELS")
    if kernels is None:
        os.environ.pop("KARA_CPU_KERNELS", None)
    else:
        os.environ["KARA_CPU_KERNELS"] = kernels
    try:
        engine = start_engine(kind, model, **kwargs)
        try:
            outs = engine.generate(PROMPTS, GREEDY)
            kernels_run = engine.get_server_info()["internal_states"][0].get(
                "kara_cpu_kernels"
            )
            if kind == "kara":
                # Out-of-vocabulary ids are rejected up front instead of crashing the scheduler.
                with pytest.raises(
                    ValueError, match="out-of-vocabulary token id 100000"
                ):
                    engine.generate(
                        input_ids=[100000, 5], sampling_params={"max_new_tokens": 2}
                    )
                ok = engine.generate(
                    input_ids=[5, 6],
                    sampling_params={"max_new_tokens": 2, "ignore_eos": True},
                )
                assert ok["meta_info"]["completion_tokens"] == 2
            return outs, kernels_run
        finally:
            engine.shutdown()
    finally:
        os.environ.pop(
            "KARA_CPU_KERNELS", None
        ) if saved is None else os.environ.__setitem__("KARA_CPU_KERNELS", saved)


@pytest.mark.parametrize(
    "kernels", [pytest.param("0", marks=pytest.mark.integration), "1"]
)  # "0": two engine starts more
def test_policy_none_matches_sglang_running_the_same_kernels(tiny_llama, kernels):
    vanilla, vanilla_kernels = _generate(
        "sglang", tiny_llama, None if kernels == "0" else "1"
    )
    mine, my_kernels = _generate(
        "kara", tiny_llama, None if kernels == "1" else "0", kara_policy="none"
    )
    # Each side says which CPU kernels it ran: plain SGLang nothing unless it opted in; sgl_kara by default.
    if kernels == "0":
        assert (
            vanilla_kernels is None
            and my_kernels["enabled"] is False
            and my_kernels["decode_attention"] == "sglang"
        )
    else:
        assert (
            vanilla_kernels == my_kernels
            and my_kernels["decode_attention"] == "batched"
        )
    for out, ref in zip(mine, vanilla):
        assert out["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
        assert "kara" not in out["meta_info"]


def test_engine_rejects_bad_option_before_loading(tiny_llama):
    import sgl_kara
    from sgl_kara.config import KaraConfigError
    from sgl_kara.startup import UnsupportedFeature

    with pytest.raises(KaraConfigError, match="--kara-retention"):
        sgl_kara.Engine(model_path=tiny_llama, kara_retention=2.0)
    with pytest.raises(UnsupportedFeature, match="--enable-mixed-chunk"):
        sgl_kara.Engine(model_path=tiny_llama, enable_mixed_chunk=True)


UNGUARDED = """
import sgl_kara
engine = sgl_kara.Engine(model_path={model!r})
print("started")
"""


@pytest.mark.integration  # a script of its own per layout
@pytest.mark.parametrize("layout", ["top level", "in a function called at top level"])
def test_a_script_without_a_main_guard_is_stopped_at_once(tiny_llama, tmp_path, layout):
    """SGLang spawns its scheduler, which runs the script again: unguarded, the child dies while it
    bootstraps and SGLang's parent blames the OOM killer a minute later. sgl_kara.Engine says what
    is wrong before it starts anything; guarded, the check lets the same code through."""
    body = UNGUARDED.format(model=tiny_llama)
    if layout != "top level":
        body = "def main():\n" + textwrap.indent(body, "    ") + "\nmain()\n"
    script = tmp_path / "example.py"
    script.write_text(body)
    t = time.time()
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0 and time.time() - t < 60, proc.stderr[-2000:]
    assert (
        "MainGuardMissing" in proc.stderr
        and 'if __name__ == "__main__":' in proc.stderr
    )
    assert (
        f"{script}, line" in proc.stderr
        and "OOM" not in proc.stderr
        and "started" not in proc.stdout
    )


def test_the_main_guard_check_passes_guarded_and_imported_code(tmp_path, monkeypatch):
    from sgl_kara import engine

    guarded = tmp_path / "guarded.py"
    guarded.write_text(
        'import sys\nif __name__ == "__main__":\n    check()\n    x = 1\ncheck_later = 2\n'
    )
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text("import sys\ncheck()\n")
    started = time.time() + 1  # the scripts were there when this process started
    monkeypatch.setattr(engine, "_process_start", lambda: started)
    for path, ok in ((guarded, True), (unguarded, False)):
        main = type(sys)("__main__")
        main.__file__ = str(path)
        main.__spec__ = None
        main.check = engine.check_main_guard
        monkeypatch.setitem(sys.modules, "__main__", main)
        code = compile(path.read_text(), str(path), "exec")
        if ok:
            exec(code, vars(main))
        else:
            with pytest.raises(engine.MainGuardMissing, match=f"{path}, line 2"):
                exec(code, vars(main))
    # A script edited since the process started: its source no longer maps to the running code.
    monkeypatch.setattr(engine, "_process_start", lambda: started - 3600)
    exec(compile(unguarded.read_text(), str(unguarded), "exec"), vars(main))
    monkeypatch.setattr(engine, "_process_start", lambda: started)
    main.__spec__ = type(
        "Spec", (), {"name": "pkg.__main__"}
    )()  # python -m pkg: spawn does not rerun it
    exec(compile(unguarded.read_text(), str(unguarded), "exec"), vars(main))
    engine.check_main_guard()  # called from this test module, not a script's top level
