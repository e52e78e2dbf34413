"""What each window policy costs in quality: perplexity on Shakespeare against the full cache, for
attention sinks (StreamingLLM), the same window without sinks, a sliding window over text positions
and chunked attention, all with the same number of recent positions. Also the positions each keeps.

Fed 16 tokens at a time (sinks evict at each commit, so a query sees sinks + its last `window`).

    python benchmarks/window_quality.py --tokens 1024 --window 256 --sinks 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import print_table, write_results  # noqa: E402

import torch  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec, KVCache  # noqa: E402
from kvgen.kv.sinks import SinkCache  # noqa: E402
from kvgen.kv.window import WindowedCache  # noqa: E402
from kvgen.quality import score  # noqa: E402
from tests.support.shakespeare import play_text  # noqa: E402

CHUNK = 16


def policies(llm: LLM, window: int, sinks: int) -> dict[str, Callable[[int], KVCache]]:
    config, spec, rerotate = llm.config, CacheSpec.for_model(llm.config), llm.model.rerotate
    return {
        "full": lambda n: ContiguousCache(spec, n),
        f"sinks {sinks} + window {window}": lambda n: SinkCache(spec, sinks, window, rerotate),
        f"window {window} (cache positions, no sinks)": lambda n: SinkCache(spec, 0, window, rerotate),
        f"sliding window {window} (text positions)": lambda n: WindowedCache.for_model(config, torch.float32, 64, window=window),
        f"chunked {window}": lambda n: WindowedCache.for_model(config, torch.float32, 64, chunk=window),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--play", default="hamlet")
    args = parser.parse_args()

    llm = LLM.load(args.model, progress=False, weights="fp32")
    ids = llm.tokenizer.encode(play_text(args.play))[: args.tokens + 1]
    rows: list[dict[str, Any]] = []
    full_ppl = None
    for name, factory in policies(llm, args.window, args.sinks).items():
        scores = score(llm.model, factory, ids, CHUNK)
        # Scored past the first window only: before it every policy sees the whole text.
        tail = scores.logprobs[args.window + args.sinks :]
        ppl = torch.exp(-tail.mean()).item()
        full_ppl = full_ppl or ppl
        rows.append({"policy": name, "perplexity_after_window": ppl, "change_pct": 100 * (ppl / full_ppl - 1),
                     "perplexity_all": scores.perplexity})  # fmt: skip
        print(rows[-1], flush=True)
    print(f"\n{args.model}, {args.play}, {args.tokens} tokens in chunks of {CHUNK}; perplexity over tokens past the first window")
    print_table(rows, ["policy", "perplexity_after_window", "change_pct", "perplexity_all"])
    path = write_results(f"window_quality-{args.model}-w{args.window}", {"config": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
