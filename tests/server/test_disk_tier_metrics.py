"""A server with a disk tier: a prefix evicted to disk comes back (same text), /metrics reports
each tier, and a server started again on the directory serves the prefix from disk."""

from __future__ import annotations

import subprocess
import sys

import openai
import requests

from kvgen.engine.config import EngineConfig
from tests.engine.test_engine import SYSTEM
from tests.server.live import MODEL_NAME, live_server
from tests.support.models import PROMPTS


def metric_values(base_url: str) -> dict[str, float]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")}


def complete(base_url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0).choices[0].text


def test_disk_tier_metrics_and_restart(smollm2, tmp_path) -> None:
    config = EngineConfig(num_blocks=64, kv_cache_dir=str(tmp_path))
    prompt = SYSTEM * 2 + PROMPTS[0]
    with live_server(smollm2, config) as server:
        text = complete(server.base_url, prompt)
        reusable = (server.engine.prompt_length(prompt) - 1) // 16  # full blocks before the last prompt token
        server.wait_idle()
        server.engine.run_locked(lambda e: e.scheduler.prefix.clear())  # every block to disk
        values = metric_values(server.base_url)
        assert values['kvgen_kv_tier_blocks{tier="ram"}'] == 0
        written = values['kvgen_kv_tier_blocks{tier="disk"}']
        assert written > 0 and values['kvgen_kv_tier_bytes{tier="disk"}'] == values["kvgen_kv_disk_written_bytes"] > 0
        assert complete(server.base_url, prompt) == text
        values = metric_values(server.base_url)
        assert values['kvgen_kv_tier_hit_blocks{tier="disk"}'] == reusable > 0
        assert values["kvgen_kv_disk_read_bytes"] > 0 and values["kvgen_kv_disk_restore_seconds"] > 0
        assert values["kvgen_kv_disk_skipped_files"] == 0
        server.assert_no_leaks()
    with live_server(smollm2, config) as restarted:  # the first server's shutdown released the directory
        assert complete(restarted.base_url, prompt) == text
        values = metric_values(restarted.base_url)
        assert values['kvgen_kv_tier_hit_blocks{tier="disk"}'] == reusable
        assert complete(restarted.base_url, prompt) == text  # now a RAM hit
        assert metric_values(restarted.base_url)['kvgen_kv_tier_hit_blocks{tier="ram"}'] == reusable


def test_serve_refuses_a_disk_budget_without_a_directory() -> None:
    result = subprocess.run([sys.executable, "-m", "kvgen", "serve", "--kv-disk-budget-mb", "10"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and "--kv-disk-budget-mb" in result.stderr and "--kv-cache-dir" in result.stderr
