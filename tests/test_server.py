"""The server on the embedded default model: OpenAI completions, chat, /v1/models."""

import pytest

from conftest import Server


@pytest.fixture(scope="module")
def server():
    srv = Server(["--kara-window", "64", "--kara-buffer", "8", "--kara-chunk-budget", "4",
                  "--kara-period", "8", "--max-total-tokens", "20000", "--max-running-requests", "16",
                  "--enable-metrics"])
    yield srv
    srv.stop()


def test_models_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    models = client.models.list()
    assert len(models.data) == 1 and "default_model" in models.data[0].id
    comp = client.completions.create(model=models.data[0].id, prompt="Hello", max_tokens=16, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 16 or comp.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=models.data[0].id, messages=[{"role": "user", "content": "Hi there"}], max_tokens=16, temperature=0
    )
    assert isinstance(chat.choices[0].message.content, str) and chat.usage.completion_tokens > 0


def test_native_generate_reports_kara_meta(server):
    import requests

    r = requests.post(server.url + "/generate", json={
        "text": "Let x = 3.", "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
    }, timeout=120)
    r.raise_for_status()
    meta = r.json()["meta_info"]["kara"]
    assert meta["compressions"] >= 2
    assert meta["kv_logical_len"] == r.json()["meta_info"]["prompt_tokens"] + 200 - 1
    assert meta["kv_physical_len"] < meta["kv_logical_len"]
