"""`kvgen serve` as a user runs it: a subprocess on a free port, answering the openai client."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import openai
import pytest
import requests

from tests.server.live import free_port
from tests.support.models import model_path


def test_kvgen_serve_refuses_kv_options_its_pool_cannot_honour() -> None:
    """Refused before the model loads, with the option named (never accepted and ignored)."""
    for options, message in [(["--kv-cache", "window"], "the 'window' cache is per-sequence"),
                             (["--kv-cache", "quantized", "--kv-residual", "8"], "drop residual"),
                             (["--kv-cache", "paged", "--kv-dtype-k", "int8"], "--kv-dtype-k")]:  # fmt: skip
        result = subprocess.run([sys.executable, "-m", "kvgen", "serve", "--no-progress", *options],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.slow
def test_kvgen_serve_answers_on_localhost() -> None:
    """Served from a pool of int8 keys and int4 values (the server takes generate's --kv-* options)."""
    path = model_path("smollm2")
    port = free_port()
    env = os.environ | {"KVGEN_API_KEY": "k"}
    command = [sys.executable, "-m", "kvgen", "serve", str(path), "--port", str(port), "--weights", "fp32",
               "--kv-budget-mb", "64", "--max-num-seqs", "8", "--kv-cache", "quantized", "--kv-dtype-k", "int8",
               "--kv-dtype-v", "int4", "--no-progress"]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "kvgen serve did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert client.models.list().data[0].id == path.stem
        reply = client.completions.create(model=path.stem, prompt="The three primary colors are", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].text
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer k"}, timeout=10).text
        assert 'kvgen_kv_storage_info{format="int8t/int4/bs16"} 1.0' in metrics
    finally:
        server.terminate()
        server.wait(timeout=30)
