"""Batch-1 greedy decode on a CUDA GPU: kvgen's CUDA-graph path against its own eager launches and
against transformers on the same bf16 weights.

    python benchmarks/gpu_decode.py --models smollm2 gemma3-270m llama-1b-shape --compile smollm2
    python benchmarks/gpu_decode.py --models gemma3-270m --compile   # no transformers + torch.compile row

The weights are random (transformers' init) on the real models' architectures and shapes
(tests/support/random_like.py): the GPU machines this runs on have no copy of the real weights, and
decode speed does not depend on the values. Every engine generates exactly N tokens (EOS ignored);
decode tok/s is (N - 1) / (t(N) - t(1)) with medians of t over rounds in which the engines take
turns, so the prompt's prefill cancels out. Results: benchmarks/results/gpu_decode-<gpu>.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgen.generate as generation  # noqa: E402
from benchmarks.common import print_table, write_results  # noqa: E402
from kvgen import LLM  # noqa: E402
from kvgen.sampling.params import SamplingParams  # noqa: E402
from tests.support.random_like import save_random_like  # noqa: E402

Generate = Callable[[int], list[int]]  # new tokens -> the generated ids (after a device sync)


def kvgen_engine(llm: LLM, ids: list[int], graphs: bool, burst: int) -> Generate:
    def run(new_tokens: int) -> list[int]:
        llm.model.use_cuda_graphs = graphs
        saved, generation.GREEDY_BURST = generation.GREEDY_BURST, burst
        try:
            return llm.generate(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)).token_ids
        finally:
            generation.GREEDY_BURST = saved
            llm.model.use_cuda_graphs = True

    return run


def transformers_engine(model: Any, ids: list[int], static: bool) -> Generate:
    prompt = torch.tensor([ids], device="cuda")
    extra = {"cache_implementation": "static"} if static else {}

    @torch.inference_mode()
    def run(new_tokens: int) -> list[int]:
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, **extra)  # fmt: skip
        return out[0, len(ids) :].tolist()

    return run


def timed(run: Generate, new_tokens: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    run(new_tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(name: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    reference = save_random_like(name, folder)
    hf = reference.to("cuda", torch.bfloat16)
    llm = LLM.load(folder, device="cuda", progress=False)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(llm.config.vocab_size, 30000), (args.prompt_tokens,), generator=generator).tolist()
    engines: dict[str, Generate] = {
        "kvgen CUDA graphs, greedy runs": kvgen_engine(llm, ids, graphs=True, burst=generation.GREEDY_BURST),
        "kvgen CUDA graphs, token by token": kvgen_engine(llm, ids, graphs=True, burst=1),
        "kvgen eager (no graphs)": kvgen_engine(llm, ids, graphs=False, burst=1),
        "transformers bf16": transformers_engine(hf, ids, static=False),
    }
    compiled_llm = None
    if name in args.kvgen_compile:  # the graphs' step through torch.compile before capture (torch_compile=True)
        compiled_llm = LLM.load(folder, device="cuda", progress=False, torch_compile=True)
        engines["kvgen CUDA graphs + torch.compile, greedy runs"] = kvgen_engine(
            compiled_llm, ids, graphs=True, burst=generation.GREEDY_BURST)  # fmt: skip
    if name in args.compile:
        compiled = copy.deepcopy(hf)
        engines["transformers bf16, static cache + torch.compile"] = transformers_engine(compiled, ids, static=True)
    outputs: dict[str, list[int]] = {}
    warmup: dict[str, float] = {}
    for engine, run in engines.items():  # graphs captured, kernels tuned, torch.compile done here
        warmup[engine] = timed(run, args.new_tokens)
        outputs[engine] = run(args.new_tokens)
    samples: dict[str, dict[int, list[float]]] = {e: {1: [], args.new_tokens: []} for e in engines}
    for _ in range(args.rounds):
        for engine, run in engines.items():  # engines take turns within each round
            for new_tokens in (1, args.new_tokens):
                samples[engine][new_tokens].append(timed(run, new_tokens))
    first = outputs["kvgen CUDA graphs, greedy runs"]
    rows = []
    for engine in engines:
        short, long = (statistics.median(samples[engine][n]) for n in (1, args.new_tokens))
        same = next((i for i, (a, b) in enumerate(zip(outputs[engine], first)) if a != b), len(first))
        rows.append({
            "model": name, "engine": engine, "decode_tok_s": (args.new_tokens - 1) / (long - short),
            "prefill_plus_first_ms": short * 1000, "first_run_s": warmup[engine],
            "tokens_equal_to_kvgen_graphs": same, "samples_s": samples[engine],
        })  # fmt: skip
    base = next(r["decode_tok_s"] for r in rows if r["engine"] == "transformers bf16")
    for row in rows:
        row["vs_transformers"] = row["decode_tok_s"] / base
    del llm, compiled_llm, hf, reference
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m", "llama-1b-shape"])
    parser.add_argument("--compile", nargs="*", default=["smollm2"], help="models that also get transformers + torch.compile")
    parser.add_argument("--kvgen-compile", nargs="*", default=["smollm2", "gemma3-270m", "llama-1b-shape"],
                        help="models that also get kvgen with torch_compile (its graphs' step compiled)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default=None, help="results file name (default gpu_decode-<gpu>)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_decode.py needs an NVIDIA GPU and a CUDA build of torch")
    gpu = torch.cuda.get_device_name()
    settings = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds, "dtype": "bfloat16"}
    name = args.name or "gpu_decode-" + gpu.lower().replace("nvidia ", "").replace(" ", "-")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            rows += measure(model, args, Path(tmp) / model)
            print_table([r for r in rows if r["model"] == model], ["model", "engine", "decode_tok_s", "vs_transformers",
                        "prefill_plus_first_ms", "tokens_equal_to_kvgen_graphs"])  # fmt: skip
            # written after every model: a run cut short keeps the models it finished
            path = write_results(name, {"gpu": gpu, "cuda": torch.version.cuda, "settings": settings, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
