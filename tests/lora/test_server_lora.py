"""LoRA adapters through the OpenAI-compatible server: the `model` field picks one (each reply equals
LLM.generate with that adapter), /v1/models lists them, load/unload at run time behind the API key,
an unload during a stream, per-adapter metrics. One live server on the shared fp32 SmolLM2 with the
peft adapters of tests/lora/conftest.py; few tokens per request."""

from __future__ import annotations

import asyncio

import openai
import pytest
import requests

from kvgen import SamplingParams
from tests.server.live import MODEL_NAME, LiveServer, live_server
from tests.server.test_openai_api import chat_ids
from tests.support.models import PROMPTS

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def want(llm, prompt: str | list[int], adapter: str | None, n: int = 6) -> str:
    return llm.generate(prompt, SamplingParams(max_new_tokens=n, adapter=adapter, ignore_eos=True)).text


@pytest.fixture(scope="module")
def server(smollm2_adapters) -> LiveServer:
    llm, _ = smollm2_adapters
    with live_server(llm, max_tokens_limit=64, api_key=KEY, allow_runtime_lora=True) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server: LiveServer, route: str, body: dict, key: str | None = KEY) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{server.base_url}/v1/{route}", json=body, headers=headers, timeout=120)


def metric_values(server: LiveServer) -> dict[str, float]:
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def test_the_model_field_selects_the_adapter(client, server, smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    extra = {"ignore_eos": True}
    # (prompt, model): each adapter here changes these 6 greedy tokens, so a wrong pick would show
    cases = [(0, MODEL_NAME, None), (0, "all-r8-rs", "all-r8-rs"), (0, "mlp-o-r16", "mlp-o-r16"), (1, "qv-r4", "qv-r4"), (1, MODEL_NAME, None)]
    texts = {}
    for prompt, model, adapter in cases:
        reply = client.completions.create(model=model, prompt=PROMPTS[prompt], max_tokens=6, temperature=0, extra_body=extra)
        assert reply.model == model and reply.choices[0].text == want(llm, PROMPTS[prompt], adapter), model
        texts[prompt, model] = reply.choices[0].text
    assert len({texts[0, m] for m in (MODEL_NAME, "all-r8-rs", "mlp-o-r16")}) == 3 and texts[1, "qv-r4"] != texts[1, MODEL_NAME]
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = chat_ids(llm, messages)
    assert want(llm, ids, "all-r8-rs") != want(llm, ids, None)
    chat = client.chat.completions.create(model="all-r8-rs", messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    assert chat.model == "all-r8-rs" and chat.choices[0].message.content == want(llm, ids, "all-r8-rs")
    response = client.responses.create(model="all-r8-rs", input="Name a colour.", max_output_tokens=6, temperature=0)
    assert response.model == "all-r8-rs"
    assert response.output_text == llm.generate(ids, SamplingParams(max_new_tokens=6, adapter="all-r8-rs")).text
    echoed = client.completions.create(model="qv-r4", prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True, logprobs=0)
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True, logprobs=0)
    assert echoed.choices[0].logprobs.token_logprobs[1:4] != base.choices[0].logprobs.token_logprobs[1:4]  # scored with it
    server.assert_no_leaks()


def test_speculative_requests_under_an_adapter(client, server, smollm2_adapters) -> None:
    """The `speculative` field with an adapter's model: lookup's drafts are verified under the
    adapter (its greedy text, drafts accepted); EAGLE, drafting from the base model's features, is a
    400 that names it."""
    llm, _ = smollm2_adapters
    before = metric_values(server)
    extra = {"ignore_eos": True, "speculative": {"method": "lookup"}}
    reply = client.completions.create(model="all-r8-rs", prompt=PROMPTS[2], max_tokens=32, temperature=0, extra_body=extra)
    assert reply.choices[0].text == want(llm, PROMPTS[2], "all-r8-rs", 32) != want(llm, PROMPTS[2], None, 32)
    accepted = "kvgen_spec_accepted_tokens"
    assert metric_values(server).get(accepted, 0) > before.get(accepted, 0)
    with pytest.raises(openai.BadRequestError, match="speculative method 'eagle' drafts from the base model"):
        client.completions.create(model="all-r8-rs", prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                  extra_body={"speculative": {"method": "eagle"}})  # fmt: skip
    server.assert_no_leaks()


def test_an_unknown_model_is_404_and_queues_nothing(client, server, smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    before = (server.engine.engine.runner.num_forwards, llm.adapters.info())
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-adapter", prompt=PROMPTS[0], max_tokens=4)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-adapter", input="hi", max_output_tokens=4)
    assert (server.engine.engine.runner.num_forwards, llm.adapters.info()) == before
    assert not server.engine.run_locked(lambda e: e.has_unfinished())


def test_models_lists_the_base_and_every_adapter(client, smollm2_adapters) -> None:
    _, adapters = smollm2_adapters
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL_NAME, *adapters]
    assert [getattr(c, "parent", None) for c in cards] == [None] + [MODEL_NAME] * len(adapters)
    assert getattr(client.models.retrieve(next(iter(adapters))), "parent", None) == MODEL_NAME  # GET /v1/models/{id}


def test_load_and_unload_at_run_time(client, server, smollm2_adapters) -> None:
    llm, adapters = smollm2_adapters
    path = str(adapters["all-r8-rs"].path)
    expected = want(llm, PROMPTS[0], "all-r8-rs")
    assert expected != want(llm, PROMPTS[0], None)
    assert post(server, "load_lora_adapter", {"lora_name": "late", "lora_path": path}, key=None).status_code == 401
    assert post(server, "load_lora_adapter", {"lora_name": "late", "lora_path": path}, key="wrong").status_code == 401
    assert "late" not in llm.adapters.info()
    loaded = post(server, "load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    try:
        assert "late" in [c.id for c in client.models.list().data]
        reply = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected
        for body, status, code in (
            ({"lora_name": "late", "lora_path": path}, 400, "adapter_exists"),
            ({"lora_name": MODEL_NAME, "lora_path": path}, 400, None),
            ({"lora_name": "bad", "lora_path": "/no/such/adapter"}, 400, "invalid_adapter"),
            ({"lora_name": "bad", "lora_path": path, "load_inplace": True}, 400, "unknown_parameter"),  # unknown fields are refused
        ):  # fmt: skip
            answer = post(server, "load_lora_adapter", body)
            assert answer.status_code == status and answer.json()["error"]["code"] == code, answer.text
        assert "bad" not in llm.adapters.info()
        assert post(server, "unload_lora_adapter", {"lora_name": "late"}, key=None).status_code == 401
    finally:
        unloaded = post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    assert "late" not in llm.adapters.info() and "late" not in [c.id for c in client.models.list().data]
    missing = post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPTS[2], max_tokens=2)


def test_runtime_endpoints_are_off_unless_enabled(smollm2_adapters) -> None:
    llm, adapters = smollm2_adapters
    body = {"lora_name": "closed", "lora_path": str(adapters["qv-r4"].path)}
    with live_server(llm) as closed_server:
        refused = post(closed_server, "load_lora_adapter", body, key=None)
        assert refused.status_code == 403 and "--allow-runtime-lora" in refused.json()["error"]["message"]
        assert post(closed_server, "unload_lora_adapter", {"lora_name": "closed"}, key=None).status_code == 403
    assert "closed" not in llm.adapters.info()


def test_runtime_endpoints_are_open_without_an_api_key_when_enabled(smollm2_adapters) -> None:
    llm, adapters = smollm2_adapters
    with live_server(llm, allow_runtime_lora=True) as open_server:
        body = {"lora_name": "open", "lora_path": str(adapters["qv-r4"].path)}
        assert post(open_server, "load_lora_adapter", body, key=None).status_code == 200
        assert "open" in llm.adapters.names()
        assert post(open_server, "unload_lora_adapter", {"lora_name": "open"}, key=None).status_code == 200
    assert "open" not in llm.adapters.info()


def test_unloading_during_a_stream_finishes_the_stream_intact(client, server, smollm2_adapters) -> None:
    llm, adapters = smollm2_adapters
    expected = want(llm, PROMPTS[0], "all-r8-rs", n=32)
    assert expected != want(llm, PROMPTS[0], None, n=32)
    assert post(server, "load_lora_adapter", {"lora_name": "going", "lora_path": str(adapters["all-r8-rs"].path)}).status_code == 200
    stream = client.completions.create(model="going", prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # the request holds the adapter now
    answer = post(server, "unload_lora_adapter", {"lora_name": "going"})
    assert answer.status_code == 202, answer.text  # deferred: in use
    assert "going" not in [c.id for c in client.models.list().data]
    with pytest.raises(openai.NotFoundError):  # new requests for it are refused at once
        client.completions.create(model="going", prompt=PROMPTS[0], max_tokens=2)
    text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == expected  # nothing lost
    server.wait_idle()
    assert "going" not in llm.adapters.info()  # gone with its last request
    server.assert_no_leaks()


def test_metrics_per_adapter(client, server, smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    before = metric_values(server)
    extra = {"ignore_eos": True}
    client.completions.create(model="k-r2", prompt=PROMPTS[1], max_tokens=3, temperature=0, extra_body=extra)
    client.completions.create(model="k-r2", prompt=PROMPTS[1], max_tokens=2, temperature=0, extra_body=extra, stream=True).close()
    server.wait_idle()
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, extra_body=extra)
    after = metric_values(server)

    def delta(name: str, adapter: str) -> float:
        key = f'{name}{{adapter="{adapter}"}}'
        return after[key] - before.get(key, 0.0)

    assert delta("kvgen_adapter_requests_total", "k-r2") == 2 and delta("kvgen_adapter_requests_total", "") == 1
    assert delta("kvgen_adapter_generation_tokens_total", "") == 4
    assert 3 <= delta("kvgen_adapter_generation_tokens_total", "k-r2") <= 5  # the closed stream may stop early
    assert after['kvgen_adapter_requests_total{adapter="qv-r4"}'] >= 0  # listed from the start
    assert after["kvgen_lora_adapters_loaded"] == len(llm.adapters.names())
    assert after["kvgen_lora_adapter_bytes"] == llm.adapters.resident_bytes() > 0


def test_a_request_whose_adapter_went_before_it_reached_the_engine_fails_alone(server, smollm2_adapters) -> None:
    """Validated while loaded, unloaded before the engine thread took it: that request ends with an
    error naming the adapter; the engine thread keeps serving."""
    llm, adapters = smollm2_adapters
    llm.load_adapter("brief", adapters["k-r2"].path)
    request = server.engine.engine.make_request("race", PROMPTS[0], SamplingParams(max_new_tokens=2, adapter="brief"))
    assert llm.unload_adapter("brief") is True  # nothing held it yet

    async def run() -> list:
        return [output async for output in server.engine.run(request)]

    outputs = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert outputs[-1].finish_reason == "error" and "'brief' is not loaded" in outputs[-1].error
    assert server.engine.is_running()
    server.assert_no_leaks()
