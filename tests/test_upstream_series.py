"""The upstream series (patches/upstream/): SGLang extension points as `git apply`-able PRs.

Default suite (no SGLang import, a second): every patch is mail-style (a ``Subject: [PATCH n/N]``
line numbered as its file, the sections a reviewer reads, then a diff of SGLang's source and of a
unit test in SGLang's layout); patches 1-4 are under 150 lines; the series applies in order to
the installed SGLang 0.5.23 (``git apply --check``, tests/patched_sglang.py); the README's table
names every patch and its detection marker.

Integration tier (tests/patched_sglang.py builds the patched tree): each patch's own unit tests
pass there with pytest; each detection marker is true on the patched SGLang and false on the
installed one; and a plain ``sglang.Engine`` on the tiny model generates the same tokens, with
the same meta_info keys, on both (no plugin uses the extension points: default behaviour is
unchanged), the patched process importing the patched tree and still loading sgl_kara's plugin.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests import patched_sglang

PATCHES = patched_sglang.series()
README = patched_sglang.SERIES_DIR / "README.md"
SECTIONS = ("Motivation:", "API:", "Who else it serves:", "Tests:")
SMALL = 4  # patches 1..SMALL stay under SMALL_LINES lines in all
SMALL_LINES = 150

# Per patch: what a plugin tests to learn that the extension point exists (by feature, never by
# version): (the import, the expression). The README's table gives the same expression.
MARKERS = {
    1: (
        "from sglang.srt.managers import tokenizer_manager",
        'hasattr(tokenizer_manager, "validate_input_ids_in_vocab")',
    ),
    2: (
        "from sglang.srt.managers import io_struct",
        'hasattr(io_struct, "RequestLevelCustomizedInfo")',
    ),
    3: (
        "from sglang.srt.sampling import sampling_params",
        'hasattr(sampling_params, "register_custom_params_validator")',
    ),
    4: (
        "from sglang.srt.managers.scheduler import Scheduler",
        'hasattr(Scheduler, "pre_decode_step")',
    ),
    5: (
        "import importlib.util",
        'importlib.util.find_spec("sglang.srt.managers.retraction_policy") is not None',
    ),
    6: (
        "from sglang.srt.layers import radix_attention",
        'hasattr(radix_attention, "register_attention_observer")',
    ),
    7: (
        "from sglang.srt.model_executor.forward_batch_info import ForwardBatch",
        'hasattr(ForwardBatch, "kv_already_cached")',
    ),
    8: (
        "import importlib.util",
        'importlib.util.find_spec("sglang.srt.mem_cache.kv_compaction") is not None',
    ),
    9: (
        "from sglang.srt.managers.tokenizer_manager import TokenizerManager",
        'hasattr(TokenizerManager, "release_event_loop")',
    ),
    10: (
        "from sglang.srt.managers.schedule_policy import PrefillAdder",
        'hasattr(PrefillAdder, "reserved_new_tokens")',
    ),
}


def _number(patch) -> int:
    return int(patch.name[:4])


def test_series_is_numbered_from_one():
    assert len(PATCHES) >= 1
    assert [_number(p) for p in PATCHES] == list(range(1, len(PATCHES) + 1))


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name[:4])
def test_patch_is_a_mail_with_sections_and_a_diff(patch):
    text = patch.read_text()
    head, sep, diff = text.partition("\ndiff --git ")
    assert sep, f"{patch.name}: no diff"
    subject = head.splitlines()[0]
    m = re.fullmatch(r"Subject: \[PATCH (\d+)/(\d+)\] [a-z_/ ]+: \S.*", subject)
    assert m, f"{patch.name}: subject line {subject!r}"
    assert (int(m.group(1)), int(m.group(2))) == (_number(patch), len(PATCHES))
    at = [head.find(s) for s in SECTIONS]
    assert all(i > 0 for i in at) and at == sorted(at), (patch.name, SECTIONS, at)
    files = patched_sglang.touched(patch)
    assert any(f.startswith("python/sglang/srt/") for f in files), files
    assert patched_sglang.test_files(patch), f"{patch.name}: no unit test"
    assert all(
        f.startswith(("python/sglang/", "test/registered/unit/")) for f in files
    ), files


def test_first_patches_are_small():
    for patch in PATCHES[:SMALL]:
        lines = len(patch.read_text().splitlines())
        assert lines < SMALL_LINES, f"{patch.name}: {lines} lines"


def test_series_applies_in_order():
    assert patched_sglang.check() is None


def test_readme_names_every_patch_and_its_marker():
    text = README.read_text()
    assert set(MARKERS) == {_number(p) for p in PATCHES}
    for patch in PATCHES:
        assert patch.name in text, patch.name
        assert MARKERS[_number(patch)][1] in text, MARKERS[_number(patch)]


# -------------------------------------------------------------------------------- integration
def _plain_env() -> dict:
    """This process's environment without sgl_kara's switches or Triton's interpreter."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KARA_", "SGLANG_PLUGINS")) and k != "TRITON_INTERPRET"
    }


@pytest.fixture(scope="module")
def tree():
    return patched_sglang.build()


@pytest.fixture(scope="module")
def unit_results(tree, tmp_path_factory):
    """testcase (file::class::name) -> outcome, of one pytest run over every patch's tests."""
    report = tmp_path_factory.mktemp("upstream_unit") / "junit.xml"
    files = [f for p in PATCHES for f in patched_sglang.test_files(p)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-o", "junit_family=xunit1", f"--junitxml={report}", *files],
        cwd=tree,
        env=patched_sglang.env(tree, _plain_env()),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert report.is_file(), proc.stdout[-6000:] + proc.stderr[-4000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        name = f"{case.get('file')}::{case.get('classname')}::{case.get('name')}"
        outcomes[name] = "failed" if failed else "skipped" if skipped else "passed"
    return outcomes, proc.stdout[-6000:]


@pytest.mark.integration
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name[:4])
def test_patch_unit_tests_pass_on_the_patched_tree(patch, unit_results):
    outcomes, log = unit_results
    for path in patched_sglang.test_files(patch):
        mine = {n: o for n, o in outcomes.items() if n.startswith(path + "::")}
        assert mine, f"{path}: no test ran\n{log}"
        assert set(mine.values()) == {"passed"}, f"{mine}\n{log}"


_MARKER_SCRIPT = """
import json, sys
markers = json.loads(sys.argv[1])
out = {}
for number, (imports, expr) in markers.items():
    scope = {}
    exec(imports, scope)
    out[number] = bool(eval(expr, scope))
print(json.dumps(out))
"""


def _markers(env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MARKER_SCRIPT, json.dumps(MARKERS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {int(k): v for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.integration
def test_markers_detect_the_extension_points(tree):
    assert _markers(patched_sglang.env(tree, _plain_env())) == dict.fromkeys(
        MARKERS, True
    )
    assert _markers(_plain_env()) == dict.fromkeys(MARKERS, False)


def _generate(env: dict, model: str, out) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.patched_sglang", "--generate", model, str(out)],
        cwd=patched_sglang.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.integration
def test_plain_engine_generates_the_same_tokens_when_patched(
    tree, tiny_llama, tmp_path
):
    pristine = _generate(_plain_env(), tiny_llama, tmp_path / "pristine.json")
    patched = _generate(
        patched_sglang.env(tree, _plain_env()), tiny_llama, tmp_path / "patched.json"
    )
    assert pristine["sglang_file"].startswith(str(patched_sglang.installed_sglang()))
    assert patched["sglang_file"].startswith(str(tree / "python" / "sglang"))
    assert pristine["plugin_loaded"] and patched["plugin_loaded"]
    assert [len(ids) for ids in pristine["output_ids"]] == [12, 12, 12]
    assert patched["output_ids"] == pristine["output_ids"]
    assert patched["meta_info_keys"] == pristine["meta_info_keys"]
