"""The commands the documents show name modules and flags that exist (default suite; no engine).

- Every ``python -m X`` in README.md, docs/, bench/RESULTS.md, its family files
  (bench/results/*.md) and patches/ names a module Python can find (``importlib.util.find_spec``;
  its parent packages are imported, nothing is run), but for a harness the results say was removed
  after their run, which must then be gone.
- Every ``sgl_kara.launch_server`` command in the README's shell blocks parses with the launcher's
  own parser -- sgl_kara's ``--kara-*`` flags (``launch_server._kara_parser``) and SGLang's server
  flags (``ServerArgs.add_cli_args``, through the adapter) -- values and choices included, and its
  Kara flags build a valid ``KaraConfig``; every flag written in the README's inline code, and in a
  launcher command anywhere in docs/, is one of that parser's.
- Every ``kara_*`` keyword of a Python block in README.md and docs/ is an Engine keyword.
- The recommended settings are one set of flags per workload, the same in docs/CONFIGURATION.md,
  README.md and bench/RESULTS.md, and the README's GPU commands use the long-reasoning one.
- docs/POLICIES.md's example policy is the one tests/test_new_policy.py runs through both
  harnesses.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from test_docs import removed_harnesses

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "bench" / "RESULTS.md"

FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
MODULE = re.compile(r"\bpython[0-9.]* -m ([A-Za-z_]\w*(?:\.\w+)*)(?![.\w<])")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w<-])")
LAUNCHER = "sgl_kara.launch_server"


def _inline_spans(text: str) -> list[str]:
    """The `code` spans of a markdown text outside its fenced blocks."""
    return re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


def _shell_lines(text: str) -> list[str]:
    """The lines of a markdown text's bash / shell / unlabelled fenced blocks, continuations joined."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "shell", ""):
            lines += body.replace("\\\n", " ").splitlines()
    return lines


def _launcher_args(line: str) -> list[str] | None:
    """The arguments after ``sgl_kara.launch_server`` on a shell line, to its end, a comment, or
    the next ``&&`` / ``|`` / ``;``; None when the line does not start the launcher."""
    if LAUNCHER not in line:
        return None
    words = shlex.split(line.split(LAUNCHER, 1)[1], comments=True)
    for i, word in enumerate(words):
        if word in ("&&", "|", ";", "||"):
            return words[:i]
    return words


@pytest.fixture(scope="module")
def parser():
    """The launcher's parser: sgl_kara's flags and SGLang's server flags, as
    ``python -m sgl_kara.launch_server`` reads them."""
    from sgl_kara import launch_server
    from sgl_kara._sglang import ServerArgs

    p = launch_server._kara_parser(add_help=False)
    ServerArgs.add_cli_args(p)
    return p


def _parse(parser, args: list[str], capsys):
    """The namespace of ``args``; fails naming argparse's message on an unknown flag or value.
    Without ``--model-path`` the launcher inserts the default model's before SGLang parses
    (``launch_server._resolve``), so a placeholder stands in for it here."""
    if not {"--model-path", "--model"} & {a.split("=")[0] for a in args}:
        args = ["--model-path", "DEFAULT_MODEL", *args]
    try:
        ns, unknown = parser.parse_known_args(args)
    except SystemExit:
        pytest.fail(f"{args}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert not unknown, f"{args}: not the launcher's: {unknown}"
    return ns


# -- modules ----------------------------------------------------------------------------------


def _module_docs() -> list[Path]:
    return [
        README,
        RESULTS,
        *sorted((ROOT / "bench" / "results").glob("*.md")),
        *DOCS,
        *sorted((ROOT / "patches").rglob("*.md")),
    ]


def test_every_documented_module_exists():
    found = {
        (path.relative_to(ROOT), m)
        for path in _module_docs()
        for m in MODULE.findall(path.read_text())
    }
    names = {m for _, m in found}
    assert {LAUNCHER, "bench.gpu_check", "pytest"} <= names, sorted(names)
    removed = removed_harnesses()
    missing = sorted(
        f"{where}: python -m {m}"
        for where, m in found
        if m not in removed and importlib.util.find_spec(m) is None
    )
    assert not missing, missing
    assert not [m for m in removed if importlib.util.find_spec(m)], removed


# -- flags ------------------------------------------------------------------------------------


def test_readme_launcher_commands_parse_with_the_launchers_parser(parser, capsys):
    from sgl_kara import config

    commands = [
        args
        for line in _shell_lines(README.read_text())
        if (args := _launcher_args(line)) is not None
    ]
    # the CPU server of the first command, and the GPU servers with --model-path
    assert len(commands) >= 3, commands
    assert any("--model-path" in args for args in commands), commands
    for args in commands:
        ns = _parse(parser, args, capsys)
        try:
            config.from_cli_namespace(ns)
        except config.KaraConfigError as e:
            pytest.fail(f"{args}: {e}")


def test_every_flag_in_the_readmes_code_is_the_launchers(parser):
    known = set(parser._option_string_actions)
    spans = [s for s in _inline_spans(README.read_text()) if s.startswith("--")]
    flags = {f for s in spans for f in FLAG.findall(s)}
    assert {"--kara-policy", "--kara-recent", "--tp-size"} <= flags, sorted(flags)
    assert not flags - known, sorted(flags - known)


def test_every_flag_of_a_launcher_command_in_the_docs_is_the_launchers(parser):
    known = set(parser._option_string_actions) | {
        "--help"
    }  # launch_server.parse answers it
    unknown = []
    for path in [README, *DOCS]:
        text = path.read_text()
        lines = _shell_lines(text) + [
            s for s in _inline_spans(text) if "launch_server" in s
        ]
        for line in lines:
            if "launch_server" not in line:
                continue
            rest = line.split("launch_server", 1)[1].split("&&")[0].split("#")[0]
            unknown += [
                f"{path.name}: {f}" for f in FLAG.findall(rest) if f not in known
            ]
    assert not unknown, unknown


def test_every_engine_keyword_in_a_python_block_exists():
    from sgl_kara import config

    keywords = {"kara_" + name for name, *_ in config._cli_fields()}
    used = {
        (path.name, k)
        for path in [README, *DOCS]
        for lang, body in FENCE.findall(path.read_text())
        if lang == "python"
        for k in re.findall(r"\b(kara_\w+)\s*=", body)
    }
    assert ("README.md", "kara_retention") in used, used
    assert not [u for u in used if u[1] not in keywords], sorted(used)


# -- one recommendation per workload ----------------------------------------------------------


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under ``heading``."""
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # the header and its rule


def _recommendations(text: str, heading: str) -> list[str]:
    """Each row's flags: its second cell's code span, or "" for a row of no flag (the defaults)."""
    out = []
    for cells in _table_after(text, heading):
        span = re.findall(r"`(--[^`]+)`", cells[1])
        assert len(span) <= 1, cells
        out.append(span[0] if span else "")
    return out


def test_the_recommended_settings_are_one_and_the_same_everywhere(parser, capsys):
    from sgl_kara import config

    canonical = _recommendations(
        (ROOT / "docs" / "CONFIGURATION.md").read_text(), "## Recommended settings"
    )
    assert len(canonical) == 4 and canonical.count("") == 1, canonical
    readme = README.read_text()
    assert _recommendations(readme, "## Which settings") == canonical
    assert (
        _recommendations(RESULTS.read_text(), "### Recommended settings by workload")
        == canonical
    )
    for flags in canonical:
        ns = _parse(parser, shlex.split(flags), capsys)
        config.from_cli_namespace(ns)  # valid values, not only names
    long_reasoning = canonical[0]
    gpu = [
        line
        for line in _shell_lines(readme)
        if LAUNCHER in line and "--model-path" in line
    ]
    assert gpu and all(long_reasoning in line for line in gpu), gpu


# -- the contributor's example ----------------------------------------------------------------


def test_the_documented_policy_is_the_tested_one():
    import test_new_policy

    blocks = [
        body
        for lang, body in FENCE.findall((ROOT / "docs" / "POLICIES.md").read_text())
        if lang == "python"
    ]
    assert [b.strip() for b in blocks] == [test_new_policy.POLICY.strip()]
