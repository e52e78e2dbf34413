"""Load time and memory of a loaded model: each sample a fresh process that loads the model with
its default weights and greedily generates a few tokens, reporting the load's wall time, the
resident memory after the load and after generating, and the process's peak resident memory.

With `--baseline-src` (another checkout's `src`, e.g. a `git worktree` of an older commit) the two
source trees take turns, one fresh process each, and the JSON keeps every sample of both.

    python benchmarks/load_memory.py                                   # SmolLM2 and Gemma 3, 3 rounds
    python benchmarks/load_memory.py --baseline-src /tmp/old/src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, print_table, write_results  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
# Run in the child: RSS from /proc (kB), the peak from getrusage (kB on Linux).
CHILD = """
import json, resource, sys, time
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
started = time.perf_counter()
from kvgen import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM.load(sys.argv[1], progress=False)
loaded = time.perf_counter()
after_load = rss_mb()
result = llm.generate("Once upon a time", SamplingParams(max_new_tokens=32))
print(json.dumps({"import_s": imported - started, "load_s": loaded - imported, "rss_after_load_mb": after_load,
                  "rss_after_generate_mb": rss_mb(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "tokens": result.token_ids, "embedding": type(llm.model.embed_tokens).__name__}))
"""


def sample(src: Path, model: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src, taking turns with this one")
    parser.add_argument("--name", default="load_memory", help="results file: results/<name>-<cpu class>.json")
    args = parser.parse_args()
    trees = {"kvgen": SRC} | ({"baseline": args.baseline_src.resolve()} if args.baseline_src else {})
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for model in args.models.split(","):
            for tree, src in trees.items():
                samples.setdefault((model, tree), []).append(sample(src, model))
    rows = []
    for (model, tree), runs in samples.items():
        rows.append({
            "model": model, "source": tree, "embedding": runs[0]["embedding"],
            **{key: statistics.median(r[key] for r in runs) for key in ("load_s", "rss_after_load_mb", "rss_after_generate_mb", "peak_rss_mb")},
            "same_tokens": all(r["tokens"] == samples[(model, "kvgen")][0]["tokens"] for r in runs),
            "samples": runs,
        })  # fmt: skip
    print_table(rows, ["model", "source", "embedding", "load_s", "rss_after_load_mb", "rss_after_generate_mb", "peak_rss_mb", "same_tokens"])
    config = {"models": args.models, "rounds": args.rounds, "baseline_src": str(args.baseline_src) if args.baseline_src else None}
    path = write_results(f"{args.name}-{cpu_class()}", {"config": config, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
