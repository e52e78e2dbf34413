"""What a speculative verify costs on a model that keeps its own state (the hybrids, Mamba-2, Mamba): the
target over the last id and k drafts in one pass that keeps the state after each position, then
the roll back to the first, against k + 1 plain one-token decode steps.

A verify yields 1 + (accepted drafts) tokens for its time, so a draft of k pays where the tokens it
yields a step exceed the verify's cost in plain steps (`verify_in_plain_steps`). No checkpoint of
these families installs offline and random weights quote nothing, so this measures the mechanism's
cost, not a speedup on text: `ceiling` is the speed-up if every draft were accepted (k + 1 tokens
per verify), the bound prompt lookup approaches on text it can copy.

Files: benchmarks/random_gguf.py's random q4 files (`--models` names their families), 256-token
context, medians of `--repeats` calls each, the calls taking turns.

    python benchmarks/state_verify.py --models nemotron-h lfm2-moe falcon-h1 mamba2 mamba
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import print_table, write_results  # noqa: E402
from peers.paths import peers_root  # noqa: E402

from kvgen import LLM  # noqa: E402
from tests.support.recurrent import random_ids  # noqa: E402


def verify_costs(llm: LLM, drafts: list[int], repeats: int) -> list[dict]:
    """Per draft length k: the median seconds of k + 1 plain steps and of one verify over them."""
    model = llm.model
    with torch.inference_mode():
        base = model.new_state_cache()
        model(torch.tensor([random_ids(256, 1)]), base)
        start, tokens = base.seq_len, random_ids(max(drafts) + 1, 2)
        samples: dict[int, dict[str, list[float]]] = {k: {"plain": [], "verify": []} for k in drafts}
        for _ in range(repeats):
            for k in drafts:
                cache = base.fork()  # each from the same 256 positions (the copy outside the timings)
                began = time.perf_counter()
                for token in tokens[: k + 1]:
                    model(torch.tensor([[token]]), cache)
                samples[k]["plain"].append(time.perf_counter() - began)
                cache = base.fork()
                began = time.perf_counter()
                cache.keep_positions = True
                model(torch.tensor([tokens[: k + 1]]), cache, logits_to_keep=k + 1)
                cache.keep_positions = False
                cache.truncate(start + 1)  # every draft rejected: back to the last id's state
                samples[k]["verify"].append(time.perf_counter() - began)
    rows = []
    for k, times in samples.items():
        plain, verify = statistics.median(times["plain"]), statistics.median(times["verify"])
        step = plain / (k + 1)
        rows.append({"drafts": k, "plain_step_ms": 1e3 * step, "verify_ms": 1e3 * verify, "verify_in_plain_steps": verify / step,
                     "ceiling": (k + 1) * step / verify, "samples_plain_s": times["plain"], "samples_verify_s": times["verify"]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["nemotron-h", "lfm2-moe", "falcon-h1", "mamba2", "mamba"])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 7])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = {}
    for family in args.models:
        folder = peers_root() / f"random-{family}"
        files = sorted(folder.glob("*.gguf"))
        if not files:
            print(f"{family}: no file in {folder}; write it with benchmarks/random_gguf.py --family {family}")
            continue
        llm = LLM.load(files[0], progress=False)
        rows = verify_costs(llm, args.drafts, args.repeats)
        print(f"\n{files[0].name} ({llm.weights} weights), {torch.get_num_threads()} threads")
        print_table(rows, ["drafts", "plain_step_ms", "verify_ms", "verify_in_plain_steps", "ceiling"])
        results[family] = {"file": files[0].name, "rows": rows}
    print(f"\nwrote {write_results('state-verify', {'config': vars(args), 'models': results})}")


if __name__ == "__main__":
    main()
