"""LoRA serving: throughput of concurrent requests over several adapters and the base model in one
engine, against the base model alone and against the adapters' requests run one adapter at a time.

Adapters: `--adapters` random rank-`--rank` LoRAs on every linear (q, k, v, o, gate, up, down; a
hybrid's mixers' in_proj and out_proj too, each where the layer has it), saved as PEFT folders
(adapter_config.json + adapter_model.safetensors, peft's key names) and loaded by kvgen.
Workload: `--concurrency` requests with distinct prompts of `--prompt-tokens`, `--new-tokens` each,
greedy, EOS ignored, prefix cache off; request i runs under adapter i % (adapters + 1) (0: the base).

    base     every request on the base model, all submitted together
    mixed    the workload above, all submitted together: adapters and base share every batch
    grouped  the same requests, one adapter's (or the base's) group at a time: the way without
             per-row adapters (merge an adapter, serve its requests, switch)

Each request is also run alone once (`LLM.generate`, its adapter): the script counts, per round, the
requests whose greedy tokens equal mixed vs grouped and mixed vs alone.

Throughput = generated tokens / wall time. `--rounds` rounds, the configurations taking turns within
each (the order rotates), every sample kept; the table shows medians. The 1-minute load average is
recorded with each sample: on a shared machine read the ratios with it.

    python benchmarks/lora.py --rounds 5
    python benchmarks/lora.py --model .venv/peers/random-nemotron-h/model-q4.gguf --name nemotron-h   # a hybrid
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import FILLER, cpu_class, print_table, write_results  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus  # noqa: E402
from kvgen.lora.adapter import projection_shapes  # noqa: E402

# projection -> the PEFT module kvgen reads it from (lora/peft_folder.py; the mixers' under Nemotron-H's names)
MODULES = {**{p: f"self_attn.{p}_proj" for p in "qkvo"}, **{p: f"mlp.{p}_proj" for p in ("gate", "up", "down")},
           "mixer_in": "mixer.in_proj", "mixer_out": "mixer.out_proj"}  # fmt: skip
CONFIGS = ("base", "mixed", "grouped")


def write_peft_adapter(llm: LLM, path: Path, rank: int, seed: int) -> None:
    """A random LoRA on every linear in peft's folder layout (what `save_pretrained` writes)."""
    config = llm.model.config
    generator = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    for layer in range(config.num_layers):
        for proj, (out_features, in_features) in projection_shapes(config, layer).items():
            module = f"base_model.model.model.layers.{layer}.{MODULES[proj]}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
            targets.add(MODULES[proj].split(".")[1])
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "target_modules": sorted(targets)}
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))


def distinct_prompts(llm: LLM, count: int, num_tokens: int) -> list[list[int]]:
    body = llm.tokenizer.encode(FILLER * (num_tokens // 20 + 2), add_special_tokens=False)
    return [(llm.tokenizer.encode(f"Request {i}:", add_special_tokens=False) + body)[:num_tokens] for i in range(count)]


def run_together(engine: LLMEngine, jobs: list[tuple[int, list[int], str | None]], new_tokens: int, tag: str) -> dict[int, list[int]]:
    """Submit every job at once and step the engine until all finish: request index -> its tokens."""
    requests = {i: engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, adapter=adapter))
                for i, prompt, adapter in jobs}  # fmt: skip
    while any(r.status is not RequestStatus.FINISHED for r in requests.values()):
        engine.step()
    return {i: r.output_ids for i, r in requests.items()}


def measure(config: str, engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int, tag: str) -> dict:
    jobs = [(i, p, None if config == "base" else adapters[i]) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    if config == "grouped":
        outputs: dict[int, list[int]] = {}
        for group in dict.fromkeys(adapters):  # base first, then each adapter: one group at a time
            outputs |= run_together(engine, [j for j in jobs if j[2] == group], new_tokens, tag)
    else:
        outputs = run_together(engine, jobs, new_tokens, tag)
    seconds = time.perf_counter() - started
    generated = sum(len(ids) for ids in outputs.values())
    assert generated == len(prompts) * new_tokens
    return {"config": config, "seconds": seconds, "tokens_per_s": generated / seconds, "load_1min": os.getloadavg()[0],
            "outputs": [outputs[i] for i in range(len(prompts))]}  # fmt: skip


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--name", default=None, help="the results' name (default: --model)")
    parser.add_argument("--weights", default=None, help="kvgen weight mode (default: the model's default)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    llm = LLM.load(args.model, progress=False, **({"weights": args.weights} if args.weights else {}))
    names = [f"adapter{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as folder:
        for i, name in enumerate(names):
            write_peft_adapter(llm, Path(folder) / name, args.rank, seed=i)
            llm.load_adapter(name, Path(folder) / name)
    adapters = [([None, *names])[i % (args.adapters + 1)] for i in range(args.concurrency)]
    prompts = distinct_prompts(llm, args.concurrency, args.prompt_tokens)
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=args.concurrency, max_tokens_per_step=512, prefix_cache=False))
    for config in CONFIGS:  # first-call costs (allocations at these shapes) out of the timings
        measure(config, engine, prompts, adapters, 4, f"warmup-{config}")

    samples: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    load_before = os.getloadavg()[0]
    for round_index in range(args.rounds):
        order = CONFIGS[round_index % 3 :] + CONFIGS[: round_index % 3]  # each configuration leads a round in turn
        for config in order:
            samples[config].append(measure(config, engine, prompts, adapters, args.new_tokens, f"{config}{round_index}"))
    # Greedy tokens of each request, mixed vs grouped (every round): a base row prefilled beside
    # adapter rows runs another kernel path than beside base rows only, so a near tie may flip.
    same = [sum(a == b for a, b in zip(m["outputs"], g["outputs"])) for m, g in zip(samples["mixed"], samples["grouped"])]
    alone = [llm.generate(p, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, adapter=a)).token_ids
             for p, a in zip(prompts, adapters)]  # fmt: skip
    same_alone = [sum(a == b for a, b in zip(m["outputs"], alone)) for m in samples["mixed"]]
    medians = {c: statistics.median(s["tokens_per_s"] for s in runs) for c, runs in samples.items()}
    rows = [{"config": c, "median_tokens_per_s": medians[c], "vs_base": medians[c] / medians["base"],
             "samples_tokens_per_s": [round(s["tokens_per_s"], 2) for s in runs],
             "load_1min": [round(s["load_1min"], 2) for s in runs]} for c, runs in samples.items()]  # fmt: skip
    summary = {"mixed_vs_base": medians["mixed"] / medians["base"], "mixed_vs_grouped": medians["mixed"] / medians["grouped"],
               "requests_with_equal_tokens_mixed_vs_grouped": same, "requests_with_equal_tokens_mixed_vs_alone": same_alone,
               "load_1min_before": load_before,
               "load_1min_after": os.getloadavg()[0]}  # fmt: skip

    print(f"\n{args.model} ({llm.weights} weights), {args.concurrency} requests: {args.adapters} rank-{args.rank} adapters on all "
          f"linears + base, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")  # fmt: skip
    print_table(rows, ["config", "median_tokens_per_s", "vs_base", "samples_tokens_per_s"])
    print(f"mixed / base {summary['mixed_vs_base']:.2f}x, mixed / grouped {summary['mixed_vs_grouped']:.2f}x, "
          f"requests with equal tokens mixed vs grouped: {same}, mixed vs alone: {same_alone} of {args.concurrency}, "
          f"load {load_before:.2f} -> {summary['load_1min_after']:.2f}")  # fmt: skip
    out = write_results(f"lora-{args.name or args.model}-{cpu_class()}", {"config": vars(args), "rows": rows, "summary": summary})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
