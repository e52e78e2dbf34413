"""Replicas on Ray Serve: the prefix-aware router against Ray's default power-of-two router, and 2
replicas against 1, on one machine, same run.

Workload: 4 system prompts of ~1,000 tokens x 8 questions each, shuffled (fixed seed), sent as
streaming chat requests by `--concurrency` clients through Ray Serve's HTTP proxy; `--new-tokens`
tokens each, greedy. Each replica's KV pool is `--kv-blocks` blocks (default: room for 2 of the 4
system prompts plus the running requests), so 2 replicas together hold all 4 only when each keeps
its own half: that, and not re-prefilling, is what routing by prefix buys.

Reported per router: prefix hit rate (of the requests whose system prompt had been sent before,
the share served with it cached: the first of each prompt cannot hit, whatever the router), the
token hit rate over all prompt tokens, mean and median time to first token (TTFT), and throughput.
Then 1 replica with both CPUs and twice the pool (same machine, same memory) on the same workload,
prefix-routed: 2 cores cannot show scaling, only the overhead of splitting them.

    python benchmarks/replicas.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import FILLER, cpu_class, print_table, write_results  # noqa: E402

import openai  # noqa: E402

from kvgen.engine.config import EngineConfig  # noqa: E402
from kvgen.llm import load_tokenizer  # noqa: E402
from kvgen.replicas.launch import connect, deploy  # noqa: E402
from kvgen.replicas.options import ReplicaOptions, ReplicaSpec  # noqa: E402
from kvgen.server.config import ServerConfig  # noqa: E402

TOPICS = ("a shipping company", "a public library", "a mountain observatory", "a hospital pharmacy")


def system_prompts(tokenizer, num_tokens: int) -> list[str]:
    """Distinct from their first block on: each names its topic before the shared filler."""
    prompts = []
    for i, topic in enumerate(TOPICS):
        head = f"System prompt {i}. You are the assistant of {topic}. Rules and background follow. "
        ids = tokenizer.encode(head + FILLER * (num_tokens // 20 + 2), add_special_tokens=False)[:num_tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


def workload(prompts: list[str], questions: int, seed: int) -> list[tuple[int, str]]:
    jobs = [(p, f"Question {q}: what should I do about item {q * 7 + p}?") for p in range(len(prompts)) for q in range(questions)]
    random.Random(seed).shuffle(jobs)
    return jobs


def one_request(client: openai.OpenAI, model: str, system: str, question: str, new_tokens: int) -> dict:
    started = time.perf_counter()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=new_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
    return {"ttft_s": first, "seconds": time.perf_counter() - started, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "generated": usage.completion_tokens}  # fmt: skip


def run(url: str, model: str, prompts: list[str], jobs: list[tuple[int, str]], concurrency: int, new_tokens: int,
        system_tokens: int) -> dict:  # fmt: skip
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda job: one_request(client, model, prompts[job[0]], job[1], new_tokens), jobs))
    seconds = time.perf_counter() - started
    seen: set[int] = set()
    could_hit = hits = 0
    for (prompt, _), result in zip(jobs, results):
        if prompt in seen:  # its system prompt was sent before: some replica held it
            could_hit += 1
            hits += result["cached_tokens"] >= 0.9 * system_tokens
        seen.add(prompt)
    ttfts = [r["ttft_s"] for r in results]
    return {
        "prefix_hit_rate": hits / could_hit,
        "token_hit_rate": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results),
        "mean_ttft_s": statistics.mean(ttfts), "median_ttft_s": statistics.median(ttfts),
        "seconds": seconds, "requests_per_s": len(jobs) / seconds,
        "generated_tokens_per_s": sum(r["generated"] for r in results) / seconds,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in results) / seconds,
        "requests": results,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=160, help="each replica's pool (1 replica: twice this)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prompts = system_prompts(load_tokenizer(args.model), args.system_tokens)
    jobs = workload(prompts, args.questions, args.seed)
    server = ServerConfig(args.model, max_tokens_limit=256)
    connect(None, num_cpus=2)

    def deployed(replicas: int, router: str, blocks: int) -> str:
        spec = ReplicaSpec(args.model, {}, EngineConfig(num_blocks=blocks), server)
        options = ReplicaOptions(replicas=replicas, cpus_per_replica=2.0 / replicas, router=router)
        return deploy(spec, options, "127.0.0.1", args.port)  # a fresh deployment: replicas start cold

    rows = []
    for label, replicas, router, blocks in (("2 replicas, prefix-aware", 2, "prefix", args.kv_blocks),
                                            ("2 replicas, power of two", 2, "pow2", args.kv_blocks),
                                            ("1 replica, 2 CPUs", 1, "prefix", 2 * args.kv_blocks)):  # fmt: skip
        url = deployed(replicas, router, blocks)
        one_request(openai.OpenAI(base_url=f"{url}/v1", api_key="x"), args.model, "Warm up.", "Hi", 2)  # load kernels
        result = run(url, args.model, prompts, jobs, args.concurrency, args.new_tokens, args.system_tokens)
        rows.append({"setup": label, "replicas": replicas, "router": router, "kv_blocks_per_replica": blocks} | result)
        print(f"{label}: done in {result['seconds']:.1f}s", file=sys.stderr)
    prefix, pow2, single = rows
    summary = {
        "ttft_speedup_prefix_vs_pow2": pow2["mean_ttft_s"] / prefix["mean_ttft_s"],
        "throughput_2_vs_1_replica": prefix["generated_tokens_per_s"] / single["generated_tokens_per_s"],
        "requests_per_s_per_replica_2": prefix["requests_per_s"] / 2, "requests_per_s_1_replica": single["requests_per_s"],
    }  # fmt: skip
    print_table(rows, ["setup", "prefix_hit_rate", "token_hit_rate", "mean_ttft_s", "median_ttft_s", "requests_per_s",
                       "generated_tokens_per_s", "prompt_tokens_per_s"])  # fmt: skip
    print({k: round(v, 3) for k, v in summary.items()})
    config = {k: getattr(args, k) for k in ("model", "system_tokens", "questions", "concurrency", "new_tokens", "kv_blocks", "seed")}
    path = write_results(f"replicas-{args.model}-{cpu_class()}", {"config": config, "summary": summary, "runs": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
