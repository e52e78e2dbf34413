"""Decode attention against the memory bound: how fast this machine streams memory (a plain read and
a copy, 1 and 2 threads), and how fast one layer's attention over an int8 or 4-bit (KIVI int4)
QuantizedCache reads its codes at depth (SmolLM2's shape: 3 kv heads x 64, 9 query heads, 30
layers; random K/V). The K/V formats take turns within each round, so their times compare in-process.

Each layer's call is timed alone and the layers are swept in order, so every call reads its K/V from
DRAM as a decode step does (30 layers x 3.2 MB at 8,192 positions, far more than the L3); a layer's
time is the fastest of the rounds (the machine may be shared) less that of a call over one
position (the Python call, ~20-30 us), and GB/s is the packed bytes
(codes + fp16 scales) it read over that time.

    python benchmarks/attention_bandwidth.py --depths 2048,8192 --kv int8,int4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_class, print_table, write_results  # noqa: E402

from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.kv.quantized import QuantizedCache  # noqa: E402
from kvgen.kv.quantized_decode_view import QuantizedDecodeView  # noqa: E402

LAYERS, KV_HEADS, HEADS, DIM = 30, 3, 9, 64


def stream_gb_s(threads: int, megabytes: int = 512, rounds: int = 7) -> dict[str, float]:
    """Best read (sum of fp32) and copy GB/s over `megabytes`, bytes moved per second."""
    torch.set_num_threads(threads)
    source = torch.ones(megabytes << 18)  # fp32: megabytes MB
    target = torch.empty_like(source)
    read = copy = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        source.sum()
        read = min(read, time.perf_counter() - started)
        started = time.perf_counter()
        target.copy_(source)
        copy = min(copy, time.perf_counter() - started)
    size = source.numel() * 4
    return {"read_gb_s": round(size / read / 1e9, 1), "copy_gb_s": round(2 * size / copy / 1e9, 1)}


KV_FORMATS = ("int8", "int4")  # K and V alike


def filled_cache(depth: int, kv: str) -> tuple[QuantizedCache, QuantizedDecodeView, int]:
    """A cache of `depth` positions with K and V in format `kv` (the last one written as the C step
    writes it), its kernel view, and the packed bytes (codes, scales, offsets) one step reads over
    all layers."""
    spec = CacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM)
    cache = QuantizedCache(spec, depth + 64, depth + 64, kv, kv)
    generator = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        keys, values = torch.randn(2, 1, KV_HEADS, depth - 1, DIM, generator=generator)
        cache.update(layer, keys * 2, values)
    cache.commit(depth - 1)
    view = QuantizedDecodeView()
    view.prepare(cache, depth)
    for layer in range(LAYERS):
        cache.write(layer, torch.randn(1, KV_HEADS, 1, DIM), torch.randn(1, KV_HEADS, 1, DIM))
    stores = (cache.key_store, cache.value_store)
    read = sum(t[:, :, : cache.num_packed_blocks].numel() * t.element_size() for s in stores for t in s.parts.values())
    return cache, view, read


def attention_ms(caches: dict[str, tuple[QuantizedCache, QuantizedDecodeView, int]], depth: int, threads: int,
                 rounds: int, start: int = 0) -> dict[str, float]:  # fmt: skip
    """Per format, milliseconds for all layers' attention over positions start..depth-1: per layer
    the fastest of `rounds` sweeps, the formats taking turns in each round."""
    torch.set_num_threads(threads)
    q, out = torch.randn(LAYERS, HEADS, DIM), torch.empty(HEADS, DIM)
    best = {kv: [float("inf")] * LAYERS for kv in caches}
    for _ in range(rounds):
        for kv, (cache, view, _) in caches.items():
            for layer in range(LAYERS):
                started = time.perf_counter()
                view.attend(cache, layer, q[layer].data_ptr(), out.data_ptr(), HEADS, DIM**-0.5, start, depth)
                best[kv][layer] = min(best[kv][layer], time.perf_counter() - started)
    return {kv: 1000 * sum(times) for kv, times in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="2048,8192", help="cache lengths, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--kv", default="int8,int4", help=f"K/V formats, comma-separated: {', '.join(KV_FORMATS)}")
    args = parser.parse_args()
    formats = [kv for kv in args.kv.split(",") if kv]
    for kv in formats:
        if kv not in KV_FORMATS:
            raise SystemExit(f"--kv: unknown format {kv!r}; choose from {', '.join(KV_FORMATS)}")
    # Most threads first, each count once: after a 1-thread OpenMP region, a later 2-thread one at
    # times ran 10x slower here.
    threads = sorted((int(t) for t in args.threads.split(",")), reverse=True)
    rows = []
    depths = [int(d) for d in args.depths.split(",")]
    caches = {depth: {kv: filled_cache(depth, kv) for kv in formats} for depth in depths}
    for t in threads:
        rows.append({"what": f"memory, {t} thread(s)", **stream_gb_s(t)})
        for depth, by_format in caches.items():
            # Less the cost of the call itself (Python, ctypes, the query's codes): one position.
            full = attention_ms(by_format, depth, t, args.rounds)
            call = attention_ms(by_format, depth, t, args.rounds, depth - 1)
            for kv, (_, _, read) in by_format.items():
                ms = full[kv] - call[kv]
                rows.append({"what": f"{kv} attention, {depth} positions, {t} thread(s)", "step_mb": round(read / 1e6, 1),
                             "attention_ms": round(ms, 2), "ms_per_layer": round(ms / LAYERS, 3),
                             "read_gb_s": round(read / ms / 1e6, 1),
                             f"vs_{formats[0]}": round(ms / (full[formats[0]] - call[formats[0]]), 2)})  # fmt: skip
    print_table(rows, ["what", "step_mb", "attention_ms", "ms_per_layer", "read_gb_s", f"vs_{formats[0]}", "copy_gb_s"])
    path = write_results(f"attention_bandwidth-{cpu_class()}", {"rounds": args.rounds, "kv": formats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
