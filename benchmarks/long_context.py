"""Decode speed at depth: batch-1 decode tokens/s with 512, 2,048 and 8,192 tokens in the cache, for
kvgen (fp32 KV and int8 KV) and llama.cpp (f16 KV and q8_0 KV) on the same GGUF, taking turns.

Each engine prefills `depth - new_tokens` prompt tokens once, then decodes `new_tokens` greedy tokens
(EOS ignored), so the decode steps run with the cache filling up to `depth`; only the decode steps
are timed (kvgen's own decode timer, the same loop around llama.cpp's `eval`). The ratio that matters
is each engine's decode time at the deepest depth over its time at 512: how far attention at depth
slows a step.

    python benchmarks/long_context.py --model smollm2 --depths 512,2048,8192
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_class, llama_class, print_table, prompt_ids, write_results  # noqa: E402

from kvgen import LLM, CacheConfig, SamplingParams  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402

KV_MODES = {"fp32": CacheConfig(), "int8": CacheConfig(kind="quantized", k_dtype="int8", v_dtype="int8"),
            "int4": CacheConfig(kind="quantized", k_dtype="int4", v_dtype="int4")}
LLAMA_KV = {"f16": 1, "q8_0": 8}  # ggml types of llama.cpp's K and V cache


def kvgen_decode(llm: LLM, ids: list[int], new_tokens: int) -> float:
    """Decode tokens/s after prefilling ids (the generator's own decode timer)."""
    result = llm.generate(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    assert len(result.token_ids) == new_tokens
    return result.timings.decode_tokens_per_second


def llama_cpp_decoder(path: Path, context: int, threads: int, kv: str) -> Callable[[list[int], int], float]:
    Llama = llama_class()
    # A quantized V cache needs flash attention in llama.cpp; turn it on for both for a fair pair.
    model = Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                  type_k=LLAMA_KV[kv], type_v=LLAMA_KV[kv], flash_attn=True, verbose=False)  # fmt: skip

    def decode(ids: list[int], new_tokens: int) -> float:
        model.reset()
        model.eval(ids)
        token = model.sample(temp=0.0, top_k=1)
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            model.eval([token])
            token = model.sample(temp=0.0, top_k=1)
        return (new_tokens - 1) / (time.perf_counter() - started)

    return decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--depths", default="512,2048,8192", help="cache lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; engines take turns in each")
    parser.add_argument("--kv", default="fp32,int8", help=f"kvgen KV modes: {', '.join(KV_MODES)}")
    parser.add_argument("--peers", default="llama.cpp", help="llama.cpp, or empty for none")
    parser.add_argument("--llama-kv", default=None,
                        help=f"llama.cpp K/V types ({', '.join(LLAMA_KV)}), comma-separated; default: those matching "
                             "--kv (f16 beside fp32, q8_0 beside int8)")  # fmt: skip
    parser.add_argument("--name", default="long_context", help="results file: results/<name>-<model>-<cpu class>.json")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    kv_modes = [k for k in args.kv.split(",") if k]
    for kv in kv_modes:
        if kv not in KV_MODES:
            raise SystemExit(f"--kv: unknown mode {kv!r}; choose from {', '.join(KV_MODES)}")
    if args.llama_kv is None:
        llama_kv = [kv for kv, peer in (("f16", "fp32"), ("q8_0", "int8")) if peer in kv_modes]
    else:
        llama_kv = [kv for kv in args.llama_kv.split(",") if kv]
        for kv in llama_kv:
            if kv not in LLAMA_KV:
                raise SystemExit(f"--llama-kv: unknown type {kv!r}; choose from {', '.join(LLAMA_KV)}")
        if "llama.cpp" not in args.peers:
            raise SystemExit("--llama-kv needs llama.cpp in --peers")
    path = resolve_model_path(args.model)
    context = max(depths) + 1
    engines: dict[str, Callable[[list[int], int], float]] = {}
    tokenizer = None
    for kv in kv_modes:
        llm = LLM.load(args.model, progress=False, max_context=context, cache=KV_MODES[kv])
        tokenizer = llm.tokenizer
        engines[f"kvgen {kv} KV"] = lambda ids, n, llm=llm: kvgen_decode(llm, ids, n)
    if "llama.cpp" in args.peers:
        for kv in llama_kv:
            engines[f"llama.cpp {kv} KV"] = llama_cpp_decoder(path, context, args.threads, kv)
    if not engines:
        raise SystemExit("no engine to run: give --kv modes, or llama.cpp in --peers with --llama-kv")
    if tokenizer is None:  # llama.cpp alone: the prompts are still kvgen's tokens of the same text
        tokenizer = LLM.load(args.model, progress=False, max_context=context).tokenizer
    samples: dict[tuple[str, int], list[float]] = {(e, d): [] for e in engines for d in depths}
    for depth in depths:
        ids = prompt_ids(tokenizer, depth - args.new_tokens)
        for _ in range(args.repeats):
            for name, decode in engines.items():  # engines take turns within each round
                samples[name, depth].append(decode(ids, args.new_tokens))
    rows = []
    for name in engines:
        base = statistics.median(samples[name, depths[0]])
        for depth in depths:
            rate = statistics.median(samples[name, depth])
            rows.append({"engine": name, "depth": depth, "decode_tok_s": round(rate, 2),
                         "step_ms": round(1000 / rate, 2), f"slowdown_vs_{depths[0]}": round(base / rate, 2),
                         "samples": [round(s, 2) for s in samples[name, depth]]})  # fmt: skip
    print_table(rows, ["engine", "depth", "decode_tok_s", "step_ms", f"slowdown_vs_{depths[0]}"])
    payload = {"model": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads, "rows": rows}
    path = write_results(f"{args.name}-{args.model}-{cpu_class()}", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
