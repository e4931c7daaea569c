"""The server on the reasoning proxy (the tests' fast model): OpenAI completions, chat, /v1/models,
per-request options, the proxy's example chain of thought."""

import pytest
from support import PROXY_MODEL, generate

pytestmark = pytest.mark.integration  # a server of its own (docs/TESTING.md, tiers)


@pytest.fixture(scope="module")
def server_args():
    """The module's server (conftest ``server``): the proxy, small windows, metrics on."""
    return {
        "args": [
            "--model-path",
            PROXY_MODEL,
            "--kara-window",
            "64",
            "--kara-buffer",
            "8",
            "--kara-chunk-budget",
            "4",
            "--kara-period",
            "8",
            "--max-total-tokens",
            "20000",
            "--max-running-requests",
            "16",
            "--enable-metrics",
        ]
    }


def test_models_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    models = client.models.list()
    assert len(models.data) == 1 and "reasoning_proxy" in models.data[0].id
    comp = client.completions.create(
        model=models.data[0].id, prompt="Hello", max_tokens=16, temperature=0
    )
    assert (
        comp.choices[0].text
        and comp.usage.completion_tokens == 16
        or comp.choices[0].finish_reason == "stop"
    )
    chat = client.chat.completions.create(
        model=models.data[0].id,
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=16,
        temperature=0,
    )
    assert (
        isinstance(chat.choices[0].message.content, str)
        and chat.usage.completion_tokens > 0
    )


def test_native_generate_reports_kara_meta(server):
    import requests

    r = requests.post(
        server.url + "/generate",
        json={
            "text": "Let x = 3.",
            "sampling_params": {
                "max_new_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=120,
    )
    r.raise_for_status()
    meta = r.json()["meta_info"]["kara"]
    assert meta["compressions"] >= 2
    assert meta["kv_logical_len"] == r.json()["meta_info"]["prompt_tokens"] + 200 - 1
    assert meta["kv_physical_len"] < meta["kv_logical_len"]


def test_per_request_options(server):
    params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    off = generate(server, "Let x = 3.", params, {"kara": {"enable": False}}).json()[
        "meta_info"
    ]["kara"]
    assert off["compressions"] == 0 and off["kv_physical_len"] == off["kv_logical_len"]
    half = generate(server, "Let x = 3.", params, {"kara": {"retention": 0.5}}).json()[
        "meta_info"
    ]["kara"]
    default = generate(server, "Let x = 3.", params).json()["meta_info"]["kara"]
    assert half["compressions"] == default["compressions"] >= 2
    assert default["kv_physical_len"] < half["kv_physical_len"] < half["kv_logical_len"]


def test_proxy_reasons_through_the_example_prompt(server):
    """The proxy's example request: it writes its chain of thought and, with full KV
    (compression off for this request), gets the answer. With Kara on, the output is the full-KV
    one until the first window is compressed and compressions are reported; after that this proxy
    goes astray (it does not stop, here: see the quality benchmark), so nothing later is asserted."""
    from pathlib import Path

    from bench.models.proxy import PROXY_MODEL_DIR

    prompt = (Path(PROXY_MODEL_DIR) / "example_prompt.txt").read_text().strip()
    params = {"max_new_tokens": 1000, "temperature": 0}
    full = generate(server, prompt, params, {"kara": {"enable": False}}).json()
    assert full["meta_info"]["completion_tokens"] > 600, full["text"][:200]
    assert (
        full["text"].rstrip().endswith("answer r32 V32=3 and r30 V30=9 last r58 V58=2")
    ), full["text"][-200:]
    kara = generate(server, prompt, params).json()
    window = 64  # --kara-window of this server
    assert kara["text"].split()[:window] == full["text"].split()[:window]
    assert kara["meta_info"]["kara"]["compressions"] >= 5
    assert (
        kara["meta_info"]["kara"]["kv_physical_len"]
        < kara["meta_info"]["kara"]["kv_logical_len"]
    )


@pytest.mark.parametrize(
    "custom, field",
    [
        ({"kara": {"retention": 1.5}}, "retention"),
        ({"kara": {"retention": "high"}}, "retention"),
        ({"kara": {"enable": "yes"}}, "enable"),
        ({"kara": {"windowz": 3}}, "windowz"),
        ({"kara": 7}, "custom_params.kara"),
    ],
)
def test_invalid_request_options_get_400(server, custom, field):
    r = generate(server, "Hi", {"max_new_tokens": 4}, custom)
    assert r.status_code == 400, r.text
    assert field in r.text
    ok = generate(server, "Hi", {"max_new_tokens": 2})
    assert ok.status_code == 200


def test_32_concurrent_openai_requests_with_mixed_options(server):
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    options = [
        None,
        {"kara": {"enable": False}},
        {"kara": {"retention": 0.5}},
        {"kara": {"retention": 0.1}},
    ]

    def one(i):
        extra = {"ignore_eos": True}
        if options[i % 4] is not None:
            extra["custom_params"] = options[i % 4]
        n = 80 + 10 * (i % 5)
        if i % 2:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Question {i}"}],
                max_tokens=n,
                temperature=0.7,
                extra_body=extra,
            )
        else:
            r = client.completions.create(
                model=model,
                prompt=f"Question {i}:",
                max_tokens=n,
                temperature=0.7,
                extra_body=extra,
            )
        return n, r.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(n == got for n, got in results), results


def test_metrics_report_compression(server):
    import requests

    text = requests.get(server.url + "/metrics", timeout=30).text
    events = [
        line
        for line in text.splitlines()
        if line.startswith("sglang:kara_events_total")
    ]
    assert events and float(events[0].split()[-1]) > 0, events
    assert "sglang:kara_tokens_dropped_total" in text


def test_frontend_fork_shares_prompt(server):
    import sglang as sgl

    metas = []

    @sgl.function
    def parallel_reasoning(s, question):
        s += (
            "Question: "
            + question
            + " Let us think step by step about every value we know. "
        )
        forks = s.fork(4)
        for f in forks:
            f += sgl.gen("steps", max_tokens=150, temperature=0.8, ignore_eos=True)
        metas.extend(f.get_meta_info("steps") for f in forks)
        s += "Done."

    backend = sgl.RuntimeEndpoint(server.url)
    for _run in range(2):
        metas.clear()
        state = parallel_reasoning.run(
            question="what is x if x = 3 + 4?", backend=backend
        )
        assert state.text().endswith("Done.")
        assert len(metas) == 4
        for meta in metas:
            assert meta["completion_tokens"] == 150
            assert meta["kara"]["compressions"] >= 1
    # The forks of the first run may be prefilled together (whether they hit each other's
    # prompt KV depends on arrival timing). Their prompt went into the radix tree uncompressed,
    # so every fork of the second run reuses it: compression never touched the shared prefix.
    hits = [m for m in metas if m["cached_tokens"] >= m["prompt_tokens"] - 2]
    assert len(hits) == 4, [(m["cached_tokens"], m["prompt_tokens"]) for m in metas]
