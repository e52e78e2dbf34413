"""What the AMX tiles do to one quantized matmul, format by format, on the models' own weights.

For each weight format in SmolLM2 and Gemma 3 270M (the first linear of each kind: q4h, q5, q8s,
q4k, q6k), a random activation of `--rows` rows goes through the kernel with the tiles on and off in
turns (`kvgen.kernels.amx_tiles`), `--rounds` times; each turn runs the call for ~0.15 s. Reports
the medians, their ratio, and the time per 16 x 16 x 32 step (a tile's rows x outputs x block,
counted over the whole matmul and multiplied by the thread count: per core). Checks that both give
the same bits. Needs a CPU with AMX (Intel Sapphire Rapids and later).

    python benchmarks/amx_steps.py --rows 16,64,512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "src"))
from common import cpu_class, print_table, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kernels import amx_tiles  # noqa: E402
from kvgen.models.quantized_linear import QuantizedLinear  # noqa: E402


def first_of_each_kind(model: torch.nn.Module) -> dict[str, QuantizedLinear]:
    found: dict[str, QuantizedLinear] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            found.setdefault(module.kind, module)
    return found


def call_seconds(linear: QuantizedLinear, x: torch.Tensor, tiles: bool) -> float:
    amx_tiles(tiles)
    linear(x, row_invariant=True)
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < 0.15:
        linear(x, row_invariant=True)
        calls += 1
    return (time.perf_counter() - started) / calls


def measure(model_name: str, linear: QuantizedLinear, rows: int, rounds: int) -> dict[str, Any]:
    x = torch.randn(rows, linear.in_features)
    amx_tiles(True)
    with_tiles = linear(x, row_invariant=True)
    amx_tiles(False)
    same = torch.equal(linear(x, row_invariant=True), with_tiles)
    samples: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):  # turns, so a busy moment on the machine hits both alike
        for tiles in (True, False):
            samples[tiles].append(call_seconds(linear, x, tiles))
    amx_tiles(True)
    on, off = statistics.median(samples[True]), statistics.median(samples[False])
    steps = rows / 16 * linear.out_features / 16 * linear.in_features / 32
    per_core = torch.get_num_threads() / steps * 1e9
    return {"model": model_name, "kind": linear.kind, "shape": f"{linear.out_features}x{linear.in_features}",
            "rows": rows, "tiles_us": on * 1e6, "vector_us": off * 1e6, "speedup": off / on,
            "tiles_ns_per_step": on * per_core, "vector_ns_per_step": off * per_core, "same_bits": same,
            "samples": {"tiles": samples[True], "vector": samples[False]}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64,512", help="activation rows per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not amx_tiles():
        sys.exit("amx_steps.py needs the AMX tiles: this CPU (or Linux, or the kernels' build) has none")
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    for model_name in ("smollm2", "gemma3-270m"):
        llm = LLM.load(model_name, progress=False)
        for kind, linear in sorted(first_of_each_kind(llm.model).items()):
            if model_name == "gemma3-270m" or kind == "q4h":
                results += [measure(model_name, linear, rows, args.rounds) for rows in rows_list]
    print_table(results, ["model", "kind", "shape", "rows", "tiles_us", "vector_us", "speedup", "tiles_ns_per_step",
                          "vector_ns_per_step", "same_bits"])  # fmt: skip
    path = write_results(f"amx_steps-{cpu_class()}", {"rounds": args.rounds, "threads": torch.get_num_threads(),
                                                     "rows": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
