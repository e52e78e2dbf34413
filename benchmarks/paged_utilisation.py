"""KV memory utilisation (tokens stored / slots allocated) on a mixed-length workload.

Requests with log-normal prompt lengths ask for max_new_tokens=256 but stop early (EOS) after a
uniform 1..256 tokens, as real requests do. A contiguous cache must be sized for prompt +
max_new_tokens up front; a paged cache takes one block at a time as the sequence grows, through the
real PagedCache / BlockPool code.

    python benchmarks/paged_utilisation.py --requests 500
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from kvgen.kv import CacheSpec, PagedCache, PagedStorage  # noqa: E402
from kvgen.kv.block_pool import BlockPool  # noqa: E402

SPEC = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1)  # accounting only: tiny storage


def workload(num_requests: int, max_new_tokens: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(max(1, int(rng.lognormvariate(5.0, 1.0))), rng.randint(1, max_new_tokens)) for _ in range(num_requests)]


def paged_slots(requests: list[tuple[int, int]], block_size: int) -> int:
    """Run every request through a PagedCache, growing token by token as decoding would."""
    total_tokens = sum(p + o for p, o in requests)
    storage = PagedStorage(SPEC, BlockPool(total_tokens // block_size + len(requests) + 1, block_size))
    slots = 0
    for prompt, output in requests:
        cache = PagedCache(storage)
        assert cache.reserve(prompt)
        for length in range(prompt + 1, prompt + output + 1):
            assert cache.reserve(length)
        slots += cache.capacity
        cache.check_invariants()
        cache.release()
    storage.pool.check_invariants()
    return slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    requests = workload(args.requests, args.max_new_tokens, args.seed)
    stored = sum(p + o for p, o in requests)
    rows = [{"cache": "contiguous (prompt + max_new_tokens)", "slots": sum(p + args.max_new_tokens for p, _ in requests)}]
    for block_size in (8, 16, 32, 64):
        rows.append({"cache": f"paged, block_size {block_size}", "slots": paged_slots(requests, block_size)})
    for row in rows:
        row["utilisation"] = stored / row["slots"]
    print(f"\n{args.requests} requests, {stored} tokens stored")
    print_table(rows, ["cache", "slots", "utilisation"])
    path = write_results("paged_utilisation", {"config": vars(args), "tokens_stored": stored, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
