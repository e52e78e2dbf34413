"""What the EAGLE head's alternatives to its first draft buy on the 4-bit SmolLM2, in one run.

1. How often the target's greedy token is among the head's top 1..4 first drafts at each reply
   position (teacher-forced: the head fed the target's features as the decoder feeds them).
2. What a verify forward costs by rows after a 1,500-token context: a chain of rows
   (`hidden_states`, the rows step) against a token tree of as many rows (`tree_hidden_states`),
   interleaved, medians.
3. In-process turns: plain decoding and EAGLE at fixed draft lengths with and without one
   alternative, the controller growing from four drafts with one alternative (kvgen's default
   before one-token drafts), and the adaptive default, each request between two plain ones (its
   ratio against their mean), order reversed every round; medians of the ratios. Every run's
   tokens must equal plain greedy decoding's.

Results: benchmarks/results/eagle_trees-<cpu class>.json.

    python benchmarks/eagle_trees.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, print_table, write_results  # noqa: E402
from speculative import task_prompt  # noqa: E402

from kvgen import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.speculative.eagle import eagle_proposer  # noqa: E402

CONFIGS = {
    "one draft": {"num_draft_tokens": 1, "adaptive": False, "draft_alternatives": 0},
    "one draft + 1 alternative": {"num_draft_tokens": 1, "adaptive": False, "draft_alternatives": 1},
    "two drafts": {"num_draft_tokens": 2, "adaptive": False, "draft_alternatives": 0},
    "two drafts + 1 alternative": {"num_draft_tokens": 2, "adaptive": False, "draft_alternatives": 1},
    "adaptive from four + 1 alternative": {"num_draft_tokens": 4, "draft_alternatives": 1},
    "adaptive (default: one-token drafts)": {},
}


@torch.inference_mode()
def reply_features(llm: LLM, task: str, new_tokens: int) -> tuple[list[int], torch.Tensor, int]:
    """The task's prompt + greedy reply ids, the target's features over them (each position's as the
    decoder hands it to the head) and where the reply starts."""
    model = llm.model
    prompt = task_prompt(llm, task)
    prompt_ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
    ids = prompt_ids + llm.generate(prompt_ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)).token_ids
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(ids))
    return ids, model.hidden_states(torch.tensor([ids[:-1]]), cache)[0], len(prompt_ids)


@torch.inference_mode()
def top_k_hits(llm: LLM, reply: tuple[list[int], torch.Tensor, int], k: int = 4,
               weights: str | Path | None = None) -> list[float]:  # fmt: skip
    """Share of a `reply_features` reply's positions whose target token is among the head's top
    1..k first drafts (the head in `weights`, or the shipped one)."""
    model = llm.model
    ids, features, start = reply
    proposer = eagle_proposer(model, weights)
    hits, positions = [0] * k, 0
    for t in range(start, len(ids) - 2):  # the feature at t and the id after it draft ids[t + 2]
        embedding = model.embed_tokens[torch.tensor([ids[t + 1]])].float()
        drafted = proposer.cache.run(features[t : t + 1], embedding)
        best = proposer.vocab[proposer.draft_logits(drafted).topk(k).indices].tolist()
        positions += 1
        if ids[t + 2] in best:
            for i in range(best.index(ids[t + 2]), k):
                hits[i] += 1
    return [h / positions for h in hits]


@torch.inference_mode()
def verify_costs(llm: LLM, context: int, repeats: int) -> dict[int, dict[str, float]]:
    """ms of the layers for 2..4 new rows after `context` positions: a chain, a tree of as many rows."""
    model = llm.model
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), context + 8)
    model.hidden_states(torch.arange(context)[None] % 1000, cache)
    runs: dict[tuple[int, str], list[float]] = {}
    for _ in range(repeats):
        for rows in (2, 3, 4):
            ids = torch.arange(5, 5 + rows)[None]
            for kind in ("chain", "tree"):
                cache.truncate(context)
                started = time.perf_counter()
                if kind == "chain":
                    model.hidden_states(ids, cache)
                else:  # the same chain as a tree: only the addressing differs
                    model.tree_hidden_states(ids, cache, [-1, *range(rows - 1)])
                runs.setdefault((rows, kind), []).append((time.perf_counter() - started) * 1000)
    return {rows: {kind: statistics.median(runs[rows, kind]) for kind in ("chain", "tree")} for rows in (2, 3, 4)}


@torch.inference_mode()
def turns(llm: LLM, task: str, rounds: int, new_tokens: int,
          configs: dict[str, dict[str, Any]] = CONFIGS) -> list[dict[str, Any]]:  # fmt: skip
    """Each of `configs` (SpeculativeConfig("eagle", ...) arguments by name) between two plain
    requests, in turns whose order reverses every round."""
    prompt = task_prompt(llm, task)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    plain = llm.generate(prompt, params).token_ids
    ratios: dict[str, list[float]] = {name: [] for name in configs}
    speeds: dict[str, list[float]] = {name: [] for name in configs}
    last: dict[str, Any] = {}
    for r in range(rounds):
        for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
            before = llm.generate(prompt, params).timings.decode_tokens_per_second
            result = llm.generate(prompt, params, speculative=SpeculativeConfig("eagle", **configs[name]))
            after = llm.generate(prompt, params).timings.decode_tokens_per_second
            if result.token_ids != plain:
                raise AssertionError(f"{name} on {task}: the tokens differ from plain greedy decoding")
            speeds[name].append(result.timings.decode_tokens_per_second)
            ratios[name].append(speeds[name][-1] / ((before + after) / 2))
            last[name] = result.speculative
    return [
        {"task": task, "eagle": name, "decode_tok_s": statistics.median(speeds[name]),
         "speedup": statistics.median(ratios[name]), "speedup_samples": ratios[name],
         "tokens_per_verify": last[name].tokens_per_verify, "verify_steps": last[name].verify_steps,
         "alternative_tokens": last[name].alternative_tokens, "acceptance_rate": last[name].acceptance_rate}  # fmt: skip
        for name in configs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tasks", default="chat,open-ended,grounded")
    parser.add_argument("--context", type=int, default=1500, help="positions before the verify rows (costs)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM.load("smollm2", progress=False)  # the default 4-bit weights
    tasks = args.tasks.split(",")
    hits = {task: top_k_hits(llm, reply_features(llm, task, args.new_tokens)) for task in tasks}
    for task, shares in hits.items():
        print(f"{task}: target token among the head's top 1..4 first drafts: {' '.join(f'{s:.3f}' for s in shares)}")
    costs = verify_costs(llm, args.context, 60)
    for rows, ms in costs.items():
        print(f"{rows} rows after {args.context} positions: chain {ms['chain']:.3f} ms, tree {ms['tree']:.3f} ms")
    rows = [row for task in tasks for row in turns(llm, task, args.rounds, args.new_tokens)]
    print_table(rows, ["task", "eagle", "decode_tok_s", "speedup", "tokens_per_verify", "verify_steps",
                       "alternative_tokens"])  # fmt: skip
    write_results(f"eagle_trees-{cpu_class()}", {
        "config": vars(args), "top_k_first_draft_hits": hits, "verify_layers_ms": costs, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
