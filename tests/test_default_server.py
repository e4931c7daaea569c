"""The README's first command, exactly as a user runs it: ``python -m sgl_kara.launch_server --port P``.

No flags of the test's own (the README says ``--port 30000``; the test takes a free port): the
default model (SmolLM2-135M-Instruct, converted once into the user's cache directory and shared by
every test that needs it), the default memory sizing, the default Kara settings. This is the test
whose absence let a server that was OOM-killed on its first request land: a chat completion through
the official openai client must answer in English, and a long generation must succeed with its
windows compressed. Then two default servers started at once must both answer.
"""

from __future__ import annotations

import threading

import pytest
import requests

from conftest import Server


@pytest.fixture(scope="module")
def default_server():
    srv = Server([], timeout=600)  # a fresh machine converts the model first (~30-60 s)
    yield srv
    srv.stop()


def _pss_mb(pid: int) -> float:
    """Proportional set size summed over the server's processes (its workers fork from the
    launcher, so RSS would count their shared pages once per process)."""
    import psutil

    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    return total / 2**20


def test_chat_answers_in_english_through_openai_client(default_server):
    import openai

    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0,
    )
    answer = chat.choices[0].message.content
    assert "Paris" in answer, answer


def test_long_generation_is_compressed(default_server):
    """700 tokens (>= 600): with the default window W=512 and period 128 the first window is
    full after 513 generated tokens and compressed within 128 more steps."""
    r = requests.post(default_server.url + "/generate", json={
        "text": "Write a long story about a dragon who learns to cook.",
        "sampling_params": {"max_new_tokens": 700, "temperature": 0, "ignore_eos": True},
    }, timeout=600)
    r.raise_for_status()
    out = r.json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 700
    kara = meta["kara"]
    assert kara["compressions"] >= 1, kara
    assert kara["kv_physical_len"] < kara["kv_logical_len"] == meta["prompt_tokens"] + 700 - 1, kara
    # The server is still alive and within the memory the README states (< 3 GB).
    assert default_server.proc.poll() is None
    pss = _pss_mb(default_server.proc.pid)
    print(f"\nDEFAULT SERVER PSS (sum over processes) after a 700-token generation: {pss:.0f} MB")
    assert pss < 3072, pss


def test_two_default_servers_at_once(default_server):
    """Two more default servers started together (beside the fixture's: three in all) both
    answer; the per-server memory defaults keep them and this test process within the machine."""
    servers, errors = [], []

    def start():
        try:
            servers.append(Server([], timeout=600))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        for srv in servers:
            r = requests.post(srv.url + "/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8, "temperature": 0,
            }, timeout=300)
            assert r.status_code == 200, r.text[:300]
            assert r.json()["choices"][0]["message"]["content"]
    finally:
        for srv in servers:
            srv.stop()
