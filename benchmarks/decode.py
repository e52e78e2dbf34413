"""Batch-1 prefill and decode speed of kvgen (each weight mode) and of the CPU engines a user would
pick instead, in the same run: transformers generate() (eager, and with its static cache and
torch.compile) and llama.cpp (llama-cpp-python) on the same GGUF file; CTranslate2 int8, OpenVINO
GenAI int4 and ONNX Runtime GenAI int4 on exports of it (benchmarks/peers/export.py, `make bench`).
An engine that is not installed or not exported is skipped, with the reason printed.

Every engine is timed the same way from outside: time to first token = generate(1 token);
decode tokens/s = (N - 1) / (time of generate(N) - time of generate(1)). Greedy, EOS ignored, the
same prompt token ids for every engine, the same thread count (torch's). Each row also says how many
of its first new tokens agree with the first kvgen row's: a check that every engine ran the model.
Every engine is loaded first; then each round times every engine in turn (so a slow spell of the
machine hits all of them), every sample is kept in the JSON, and the table shows the medians.
The roofline: a decode step must read every weight once, so weight bytes x tokens/s is the memory
traffic achieved, compared with the bandwidth this machine measures for a streaming read.

    python benchmarks/decode.py --model smollm2 --prompt-tokens 128 --new-tokens 256

--model also takes a .gguf path (results named after the file), e.g. one benchmarks/quantize_gguf.py
wrote; give it `--peers llama.cpp` (the other peers read exports of a known model).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, cpu_class, llama_class, model_label, print_table, prompt_ids, timed, write_results  # noqa: E402
from peers.runners import PEER_RUNNERS, PeerUnavailable  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.llm import load_tokenizer  # noqa: E402
from kvgen.kernels.build import kernel_arch  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402


Generate = Callable[[int], list[int]]  # n -> the n new token ids
PEERS = ("transformers", "transformers-compiled", "llama.cpp", *PEER_RUNNERS)


def measure_round(generate: Generate, prompt_tokens: int, new_tokens: int) -> tuple[dict[str, float | None], list[int]]:
    """One sample and the tokens generated. new_tokens 1 measures prefill only (a decode rate from a
    handful of tokens is noise)."""
    tokens: list[int] = []

    def run(n: int) -> None:
        tokens[:] = generate(n)

    first = timed(lambda: run(1))
    if new_tokens <= 1:
        return {"time_to_first_token_s": first, "prefill_tokens_per_s": prompt_tokens / first,
                "decode_tokens_per_s": None, "total_s": first}, tokens  # fmt: skip
    full = timed(lambda: run(new_tokens))
    return {
        "time_to_first_token_s": first,
        "prefill_tokens_per_s": prompt_tokens / first,
        "decode_tokens_per_s": (new_tokens - 1) / (full - first),
        "total_s": full,
    }, tokens


def agreeing_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens two greedy generations share."""
    count = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        count += 1
    return count


def medians(samples: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Per measure, the median over the rounds (None where the measure is not taken, e.g. decode on a prefill run)."""
    return {key: None if first is None else statistics.median(s[key] for s in samples) for key, first in samples[0].items()}


def kvgen_runner(llm: LLM, ids: list[int]) -> Generate:
    def generate(n: int) -> list[int]:
        result = llm.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        assert len(result.token_ids) == n
        return list(result.token_ids)

    return generate


def llama_cpp_runner(path: Path, ids: list[int], threads: int) -> Generate:
    try:
        Llama = llama_class()
    except RuntimeError as error:
        raise PeerUnavailable(str(error)) from error
    except ImportError as error:
        raise PeerUnavailable(f"llama-cpp-python is not installed (make .venv/.bench-deps): {error}") from error

    context = max(2048, len(ids) + 256)  # the prompt and the new tokens
    model = Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    def generate(n: int) -> list[int]:
        model.reset()  # otherwise generate() reuses the previous call's KV for a matching prompt prefix
        out = []
        for token in model.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out

    return generate


def weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads: every block matmul weight and the output head, in memory format;
    of a mixture's experts, the share a token runs (experts_per_token of num_experts)."""
    config = getattr(llm.model.config, "decoder", llm.model.config)  # a hybrid's MLPs: its decoder part
    total = 0.0
    for name, module in [*llm.model.layers.named_modules(), ("lm_head", llm.model.lm_head)]:
        share = config.experts_per_token / config.num_experts if ".experts." in f".{name}." else 1.0
        if hasattr(module, "blocks"):
            total += module.blocks.numel() * share
        elif hasattr(module, "weight16"):  # 16bit weights
            total += module.weight16.numel() * 2 * share
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size() * share
    return int(total)


def memory_bandwidth_gbs(size_mib: int = 1024) -> float:
    """Streaming-read bandwidth: the best of several sums over a buffer far larger than the caches."""
    data = torch.ones(size_mib * 2**20 // 4)
    data.sum()
    return data.numel() * 4 / best_of(5, lambda: timed(data.sum)) / 1e9


def fresh_inductor_cache() -> None:
    """Point torch.compile at an empty cache for this process (removed at exit). The shared cache in
    /tmp keeps kernels from earlier runs, some under another instruction-set setting
    (emulate_avx2.sh); reusing those aborted a native run inside the compiled step (free(): invalid
    pointer), where a fresh compile ran clean."""
    folder = tempfile.mkdtemp(prefix="kvgen-bench-inductor-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder


def transformers_runner(path: Path, ids: list[int], dtype: torch.dtype, compiled_for: int = 0) -> Generate:
    """transformers on the same GGUF (dequantized to fp32: its only CPU path for these weights).
    compiled_for > 0: its static cache with the decode step under torch.compile (transformers' own
    recipe; prefill stays eager), compiled here for a generate(compiled_for), outside the timings."""
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    input_ids = torch.tensor([ids])
    options: dict[str, Any] = {}
    if compiled_for:
        # mode "default": transformers' "reduce-overhead" means CUDA graphs; and generate() compiles
        # only on accelerators unless told to compile on every device.
        compile_config = CompileConfig(dynamic=False, mode="default")
        compile_config._compile_all_devices = True
        fresh_inductor_cache()
        options = {"cache_implementation": "static", "compile_config": compile_config}

    def generate(n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0, **options)  # fmt: skip
        assert out.shape[1] == len(ids) + n
        return out[0, len(ids) :].tolist()

    if compiled_for:
        # Compile now, for the longest call: each generate() sizes its static cache to the longest
        # prompt + n seen so far, so every shorter call after this one reuses the same graph.
        generate(compiled_for)
    return generate


# Peers that pick their instruction set at run time with no way to cap it (emulate_avx2.sh).
UNCAPPED_PEERS = ("openvino", "onnxruntime-genai")


def load_peer(name: str, model: str, path: Path, ids: list[int], new_tokens: int, threads: int) -> Generate:
    if kernel_arch() is not None and name in UNCAPPED_PEERS:
        raise PeerUnavailable(f"KVGEN_KERNEL_ARCH emulates an older instruction set, and {name} cannot be held to it")
    if name == "transformers":
        return transformers_runner(path, ids, torch.float32)
    if name == "transformers-compiled":
        if new_tokens <= 1:
            raise PeerUnavailable("a prefill-only run: transformers compiles the decode step only, prefill runs eager")
        return transformers_runner(path, ids, torch.float32, compiled_for=new_tokens)
    if name == "llama.cpp":
        return llama_cpp_runner(path, ids, threads)
    return PEER_RUNNERS[name](model, ids, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every engine runs once per round")
    parser.add_argument("--pause", type=float, default=1.0,
                        help="idle seconds before each engine's turn, so that no engine runs beside the thread pool "
                             "the previous one left spinning; an untimed one-token call then wakes the engine's own")
    parser.add_argument("--weights", default="q4,int8,fp32", help="kvgen weight modes to run, comma-separated")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}; empty for none")
    parser.add_argument("--name", default="decode", help="results file: results/<name>-<model>-<cpu class>.json")
    args = parser.parse_args()

    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers {unknown}: choose from {', '.join(PEERS)}")
    path = resolve_model_path(args.model)
    label = model_label(args.model)
    bandwidth = memory_bandwidth_gbs()
    threads = torch.get_num_threads()
    engines: list[tuple[dict[str, Any], Generate]] = []  # (row, generate), all loaded first
    ids = prompt_ids(load_tokenizer(args.model), args.prompt_tokens)  # peers-only runs need them too
    for mode in [m for m in args.weights.split(",") if m]:
        llm = LLM.load(args.model, progress=False, weights=mode)
        engines.append(({"engine": f"kvgen ({llm.weights})", "weight_mb": weight_bytes(llm) / 1e6}, kvgen_runner(llm, ids)))
    for peer in peers:
        try:
            engines.append(({"engine": peer}, load_peer(peer, args.model, path, ids, args.new_tokens, threads)))
        except PeerUnavailable as reason:
            print(f"skipping {peer}: {reason}")
    if not engines:
        parser.error("no engine to run: give --weights or --peers that are installed")
    for _, generate in engines:
        generate(2)  # warm up allocators and kernels
    samples: list[list[dict[str, float | None]]] = [[] for _ in engines]
    tokens: list[list[int]] = [[] for _ in engines]  # each engine's tokens in the last round
    for _ in range(args.repeats):
        for i, (_, generate) in enumerate(engines):
            # ONNX Runtime's pool spins for a while after a call: kvgen's 128-token prefill right after
            # it ran at 1,145 tok/s against 1,838 after a pause, 1,964 alone.
            time.sleep(args.pause)
            generate(1)
            sample, tokens[i] = measure_round(generate, len(ids), args.new_tokens)
            samples[i].append(sample)
    rows: list[dict[str, Any]] = []
    for (row, _), engine_samples, engine_tokens in zip(engines, samples, tokens):
        row = {**row, **medians(engine_samples), "agreeing_tokens": agreeing_prefix(engine_tokens, tokens[0]),
               "samples": engine_samples, "tokens": engine_tokens}  # fmt: skip
        if row["decode_tokens_per_s"] and "weight_mb" in row:
            row["achieved_gbs"] = row["weight_mb"] / 1e3 * row["decode_tokens_per_s"]
            row["roofline_fraction"] = row["achieved_gbs"] / bandwidth
        rows.append(row)
    for peer in ("transformers", "llama.cpp"):
        base = next((r for r in rows if r["engine"] == peer), None)
        if base is None:
            continue
        for row in rows:
            if row["decode_tokens_per_s"]:
                row[f"decode_vs_{peer}"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            row[f"prefill_vs_{peer}"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]

    print(f"\n{label}, batch 1, {len(ids)}-token prompt, {args.new_tokens} new tokens, greedy, "
          f"{threads} threads, medians of {args.repeats} rounds; memory bandwidth {bandwidth:.1f} GB/s; "
          f"agreeing_tokens: leading new tokens equal to {rows[0]['engine']}'s")  # fmt: skip
    print_table(rows, ["engine", "prefill_tokens_per_s", "decode_tokens_per_s", "agreeing_tokens", "prefill_vs_transformers",
                       "decode_vs_transformers", "decode_vs_llama.cpp", "prefill_vs_llama.cpp", "achieved_gbs",
                       "roofline_fraction"])  # fmt: skip
    config = {k: getattr(args, k) for k in ("model", "prompt_tokens", "new_tokens", "repeats", "weights", "peers", "pause")}
    path = write_results(f"{args.name}-{label}-{cpu_class()}", {"config": config, "memory_bandwidth_gbs": bandwidth, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
