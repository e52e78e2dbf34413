"""In-process A/B of batch-1 decode with the quantized weights on transparent huge pages (as loaded)
against the same bytes copied onto ordinary 4 KB pages.

One model, two copies of every repacked weight; each turn points the quantized linears and a C
decode step built over that copy at one side, alternating, so a slow spell of the machine hits
both. Each round times generate(N) - generate(1) per side and counts only if other processes kept
the CPUs under --quiet busy meanwhile (this machine is shared); medians, the median paired ratio
and how much of each copy the kernel put on huge pages are printed, and written with every sample
to benchmarks/results/weight_pages-<model>-<cpu class>.json; both sides' tokens must agree.

    python benchmarks/weight_pages_ab.py --model gemma3-270m --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, write_results  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.models.fast_decode import FastDecoder  # noqa: E402
from kvgen.models.quantized_linear import QuantizedLinear  # noqa: E402


def huge_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of these tensors that sit on huge pages (AnonHugePages of their mappings in smaps)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            low, high = (int(part, 16) for part in fields[0].split("-"))
            current = (low, high) if any(low < end and start < high for start, end in spans) else None
        elif current is not None and fields[0] == "AnonHugePages:":
            total += int(fields[1]) * 1024
    return total


def busy_seconds() -> float:
    """CPU time all processes spent busy so far (/proc/stat: user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quiet", type=float, default=0.1, help="most CPU share other processes may take in a counted round")
    args = parser.parse_args()

    llm = LLM.load(args.model, progress=False)
    model = llm.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    copies = {"huge": [m.blocks for m in linears], "4k": [m.blocks.clone() for m in linears]}

    def point_at(side: str) -> None:
        for module, tensor in zip(linears, copies[side]):
            module.blocks, module._blocks_ptr = tensor, tensor.data_ptr()

    decoders = {}
    for side in copies:
        point_at(side)
        decoders[side] = FastDecoder(model)  # its C structs point at this copy
    size = sum(t.numel() for t in copies["huge"])
    for side, blocks in copies.items():
        print(f"{side}: {huge_bytes(blocks) / 1e6:.1f} of {size / 1e6:.1f} MB on huge pages")

    def use(side: str) -> None:
        point_at(side)
        model._fast_decoder = decoders[side]

    ids = llm.tokenizer.encode("The history of the printing press begins")

    def generate(n: int) -> list[int]:
        return llm.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids

    rates: dict[str, list[float]] = {side: [] for side in copies}
    tokens: dict[str, list[int]] = {}
    tried = 0
    while len(rates["huge"]) < args.rounds and tried < 20 * args.rounds:
        busy, own, wall = busy_seconds(), time.process_time(), time.perf_counter()
        sample = {}
        for side in list(copies) if tried % 2 == 0 else list(copies)[::-1]:
            use(side)
            start = time.perf_counter()
            generate(1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            tokens[side] = generate(args.new_tokens)
            sample[side] = (args.new_tokens - 1) / (time.perf_counter() - start - first)
        share = ((busy_seconds() - busy) - (time.process_time() - own)) / ((time.perf_counter() - wall) * (os.cpu_count() or 1))
        counted = tried > 0 and share < args.quiet  # try 0 warms up
        if counted:
            for side, rate in sample.items():
                rates[side].append(rate)
        print(f"try {tried}: others {share:.0%} of the CPUs, " + ", ".join(f"{s} {r:.1f}" for s, r in sample.items())
              + (" (counted)" if counted else ""), flush=True)  # fmt: skip
        tried += 1
    print(f"{len(rates['huge'])} quiet rounds of {tried}")
    assert tokens["huge"] == tokens["4k"], "the two copies' tokens differ"
    for side, values in rates.items():
        print(f"{args.model} {side:4s} decode tok/s: median {statistics.median(values):7.1f}  "
              f"[{', '.join(f'{v:.1f}' for v in values)}]")  # fmt: skip
    ratios = [h / p for h, p in zip(rates["huge"], rates["4k"])]
    print(f"{args.model} huge / 4k: median paired ratio {statistics.median(ratios):.3f}  "
          f"[{', '.join(f'{r:.3f}' for r in ratios)}]")  # fmt: skip
    path = write_results(f"weight_pages-{args.model}-{cpu_class()}", {
        "model": args.model, "new_tokens": args.new_tokens, "quiet": args.quiet, "tries": tried,
        "threads": torch.get_num_threads(), "huge_page_bytes": {side: huge_bytes(b) for side, b in copies.items()},
        "decode_tok_s": rates, "median_paired_ratio": statistics.median(ratios), "ratios": ratios,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
