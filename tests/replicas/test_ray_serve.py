"""2 engine replicas on a local Ray instance (2 CPUs, 1 each), driven by the official openai client
through Ray Serve's HTTP proxy, against a single kvgen server on the same weights."""

from __future__ import annotations

import concurrent.futures
import json
import time

import openai
import pytest
import requests

from kvgen.engine.config import EngineConfig
from kvgen.server.config import ServerConfig
from tests.server.live import MODEL_NAME, free_port, live_server
from tests.support.models import model_path

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ENGINE = EngineConfig(num_blocks=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def single(smollm2):
    with live_server(smollm2, ENGINE, max_tokens_limit=256) as live:
        yield openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from kvgen.replicas.launch import connect, deploy
    from kvgen.replicas.options import ReplicaOptions, ReplicaSpec

    connect(None, num_cpus=2)
    spec = ReplicaSpec(str(model_path("smollm2")), {"weights": "fp32"}, ENGINE, ServerConfig(MODEL_NAME, max_tokens_limit=256))
    url = deploy(spec, ReplicaOptions(replicas=2, cpus_per_replica=1.0), "127.0.0.1", free_port())
    try:
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture()
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, content: str, **options):
    options = {"max_tokens": 12, "temperature": 0} | options
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}], **options)


def test_outputs_equal_the_single_servers_at_temperature_0(client: openai.OpenAI, single: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        ours = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        theirs = single.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert ours.choices[0].text == theirs.choices[0].text and ours.usage.completion_tokens == 12
    assert _chat(client, "Name a color.").choices[0].message.content == _chat(single, "Name a color.").choices[0].message.content
    structured = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    ours = _chat(client, "Describe a person as JSON.", **structured | {"max_tokens": 40})
    theirs = _chat(single, "Describe a person as JSON.", **structured | {"max_tokens": 40})
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert set(json.loads(ours.choices[0].message.content)) == {"name", "age"}
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # the replica's own errors come back
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert client.models.list().data[0].id == MODEL_NAME


def test_streaming_equals_the_whole_answer(client: openai.OpenAI, single: openai.OpenAI) -> None:
    stream = _chat(client, "Tell me about the sea.", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices]) > 3  # arrived as several events
    assert text == _chat(single, "Tell me about the sea.").choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12


def test_a_shared_prefix_is_served_from_one_replicas_cache(client: openai.OpenAI, cluster: str) -> None:
    system = "You answer questions about the solar system, briefly and precisely. " * 10
    replies = [client.chat.completions.create(model=MODEL_NAME, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: how far is planet {i}?"}])
        for i in range(4)]  # fmt: skip
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached[0] == 0 and min(cached[1:]) >= 96, cached  # every later one found the system prompt's blocks
    time.sleep(2.5)  # a stats period: the replicas' reports reach the board
    metrics = requests.get(f"{cluster}/metrics", timeout=30).text
    assert "kvgen_replicas_up 2" in metrics
    rates = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvgen_replica_prefix_hit_rate{")]
    assert len(rates) == 2 and max(rates) > 0.5, metrics


def _replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "KvgenEngine" in a["name"])


def _wait_for_replicas(old: set[str], count: int, timeout: float = 180) -> list[str]:
    from ray import serve

    deadline = time.monotonic() + timeout
    while True:
        names = _replica_actors()
        status = serve.status().applications["kvgen"].deployments["KvgenEngine"]
        if len(names) == count and not old & set(names) and status.replica_states.get("RUNNING") == count:
            return names
        assert time.monotonic() < deadline, f"replicas not replaced: {names} {status}"
        time.sleep(1)


def test_killed_replicas_are_replaced_and_nothing_hangs(client: openai.OpenAI) -> None:
    """One replica killed under load: every request still succeeds (sent again when its replica died
    before answering). Both killed mid-stream: the stream ends with an error, not a hang. Ray starts
    new replicas, which then serve."""
    names = _replica_actors()
    assert len(names) == 2
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_chat, client, f"Count to {i}.") for i in range(4)]
        time.sleep(0.5)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        assert all(f.result(timeout=120).choices[0].message.content for f in futures)

    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Write a long story."}],
                                            max_tokens=200, temperature=0, stream=True)  # fmt: skip
    next(iter(stream))
    killed = set(names) | set(_replica_actors())
    for name in killed - {names[0]}:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="died"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 60

    _wait_for_replicas(killed, 2)
    assert all(_chat(client, p).choices[0].message.content for p in PROMPTS)
