"""The README's first command, exactly as a user runs it: ``python -m sgl_kara.launch_server --port P``.

No flags of the test's own (the README says ``--port 30000``; the test takes a free port): the
default model (SmolLM2-135M-Instruct, converted once into the user's cache directory and shared by
every test that needs it), the default memory sizing, the default Kara settings. The two requests
are the README's quick start, read from README.md: its OpenAI-client snippet runs as written (only
the address changed) and must answer in English, and its long ``/generate`` request must come back
with exactly the ``meta_info.kara`` the README documents. Then two default servers started at once
must both answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests
from support import servers_at_once

pytestmark = pytest.mark.integration  # a server of its own (docs/TESTING.md, tiers)

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _readme_block(lang: str, containing: str) -> str:
    """The README's fenced ``lang`` code block that contains ``containing``."""
    blocks = [
        b for b in re.findall(rf"```{lang}\n(.*?)```", README, re.S) if containing in b
    ]
    assert len(blocks) == 1, (
        f"README.md: expected one {lang} block with {containing!r}, found {len(blocks)}"
    )
    return blocks[0]


def _readme_long_request() -> tuple[str, dict, dict]:
    """(path, JSON body, documented meta_info.kara) of the README's long-answer curl command."""
    block = _readme_block("bash", "localhost:30000/generate")
    path = re.search(r"localhost:30000(/\w+)", block).group(1)
    body = json.loads(re.search(r"-d '(.*?)'", block, re.S).group(1))
    documented = json.loads(re.search(r"# meta_info\.kara: (\{.*\})", block).group(1))
    return path, body, documented


@pytest.fixture(scope="module")
def server_args():
    """The README's first command: no flags (a fresh machine converts the model first, ~30-60 s)."""
    return {"args": [], "timeout": 600}


@pytest.fixture(scope="module")
def default_server(server):
    return server


def _pss_mb(pid: int) -> float:
    """Proportional set size summed over the server's processes (its workers fork from the
    launcher, so RSS would count their shared pages once per process)."""
    import psutil

    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            total += next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")
            )
    return total / 2**20


def test_chat_answers_in_english_through_openai_client(default_server, capsys):
    """The README's OpenAI-client snippet, run as written against this server."""
    pytest.importorskip("openai")
    code = _readme_block("python", "from openai import OpenAI")
    assert "http://localhost:30000/v1" in code
    scope: dict = {}
    exec(
        compile(
            code.replace("http://localhost:30000", default_server.url),
            "README.md",
            "exec",
        ),
        scope,
    )
    answer = scope["chat"].choices[0].message.content
    assert "Paris" in answer, answer
    assert answer in capsys.readouterr().out  # the snippet prints it


def test_long_generation_is_compressed_as_documented(default_server):
    """The README's 700-token story: with the default window W=512 and period 128 the first window
    is full after 513 generated tokens and compressed at the request's own token 640, once."""
    path, body, documented = _readme_long_request()
    assert body["sampling_params"]["max_new_tokens"] >= 600, body
    r = requests.post(default_server.url + path, json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    meta = out["meta_info"]
    new_tokens = body["sampling_params"]["max_new_tokens"]
    assert meta["completion_tokens"] == new_tokens
    kara = meta["kara"]
    assert kara["kv_logical_len"] == meta["prompt_tokens"] + new_tokens - 1, kara
    # What the README documents does not vary with load: the request is due at its own token counts
    # (--kara-phase request), so its event, peak and mean are the same whatever else runs.
    assert set(documented) <= set(kara), (kara, documented)
    for key, value in documented.items():
        if key == "kv_mean_len":
            assert abs(kara[key] - value) < 0.05, (
                key,
                kara,
                documented,
            )  # printed to 0.1
        else:
            assert kara[key] == value, (key, kara, documented)
    assert kara["kv_physical_len"] < kara["kv_logical_len"]
    # The server is still alive and within its memory budget (< 3 GB of PSS).
    assert default_server.proc.poll() is None
    pss = _pss_mb(default_server.proc.pid)
    print(
        f"\nDEFAULT SERVER PSS (sum over processes) after a 700-token generation: {pss:.0f} MB"
    )
    assert pss < 3072, pss


def test_two_default_servers_at_once(default_server):
    """Two more default servers started together (beside the fixture's: three in all) both
    answer; the per-server memory defaults keep them and this test process within the machine."""
    with servers_at_once({i: dict(args=[], timeout=600) for i in range(2)}) as started:
        for srv in started.values():
            r = requests.post(
                srv.url + "/v1/chat/completions",
                json={
                    "model": "default",
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
                timeout=300,
            )
            assert r.status_code == 200, r.text[:300]
            assert r.json()["choices"][0]["message"]["content"]
        assert len(started) == 2
