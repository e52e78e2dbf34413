"""Shared by the benchmark scripts: prompts of an exact length, timing, and stamped JSON results."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kvgen.kernels.build import cpu_flags, kernel_arch, kernel_isa

RESULTS_DIR = Path(__file__).parent / "results"
# Plain English prose, repeated and cut to an exact token count so every engine sees the same ids.
FILLER = (
    "The history of the city begins with a small settlement on the river, where farmers and traders met "
    "to exchange grain, wool and salt. Over the centuries the market grew into a town, the town built walls, "
    "and the walls were replaced by wide streets lined with houses, workshops and churches. "
)


def prompt_ids(tokenizer: Any, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(FILLER * (num_tokens // 20 + 1), add_special_tokens=False)
    return ids[:num_tokens]


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """The fastest of `repeats` runs: the least disturbed by the rest of the machine."""
    return min(run() for _ in range(repeats))


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def machine() -> dict[str, Any]:
    try:  # checkouts.py and A/B runs load this file beside older kvgens, which lack it
        from kvgen.kernels.build import amx_tiles
    except ImportError:
        amx_tiles = None

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_class": cpu_class(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_arch": kernel_arch() or "native",
        "kernel_amx_tiles": amx_tiles() if amx_tiles is not None else None,  # None: a kvgen from before them
        "python": platform.python_version(),
    }


def isa_class(flags: frozenset[str]) -> str:
    """"avx512-amx", "avx512-vnni", "avx512", "avx2" or "other", from /proc/cpuinfo's flag names.
    AMX (Intel's int8 / bf16 tile units) is a class of its own: kvgen's quantized matmuls run many
    rows in its int8 tiles (amx_tiles.c), and oneDNN's int8 and bf16 GEMMs, and so some peers, use
    them too."""
    if "avx512f" in flags:
        if "amx_int8" in flags:
            return "avx512-amx"
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    return "avx2" if "avx2" in flags else "other"


def cpu_class() -> str:
    """The CPU class a result belongs to ("avx512-vnni", "avx512", "avx2" or "other"): tables are
    kept per class, since kvgen's kernels take different paths on each. With KVGEN_KERNEL_ARCH
    (an older instruction set emulated, benchmarks/emulate_avx2.sh) it is "<kernels' class>-on-<CPU's>"."""
    native = isa_class(cpu_flags())
    return native if kernel_arch() is None else f"{isa_class(kernel_isa())}-on-{native}"


def llama_class() -> type:
    """llama-cpp-python's Llama (ImportError where it is not installed); RuntimeError when an older
    instruction set is emulated (KVGEN_KERNEL_ARCH) and this llama.cpp build uses AVX-512."""
    import llama_cpp

    if "amx_int8" in cpu_flags():
        without_amx_buffers()
    if kernel_arch() is not None and "AVX512 = 1" in llama_cpp.llama_print_system_info().decode():
        raise RuntimeError("KVGEN_KERNEL_ARCH emulates an older instruction set, and this llama.cpp build uses "
                           "AVX-512: make .venv/llama-avx2 (benchmarks/emulate_avx2.sh puts it on PYTHONPATH)")  # fmt: skip
    return llama_cpp.Llama


def without_amx_buffers() -> None:
    """Load llama.cpp models without its extra buffer types: on a 2-core Xeon with AMX, the weights
    llama-cpp-python 0.3.36 repacks for AMX segfault in the first llama_decode (SmolLM2's Q4_1 and
    Q8_0 tensors), so its fastest working setting there is the plain CPU buffers."""
    import llama_cpp.llama_cpp as bindings

    default = bindings.llama_model_default_params
    if getattr(default, "without_extra_buffers", False):
        return

    def params():  # type: ignore[no-untyped-def]
        chosen = default()
        chosen.use_extra_bufts = False
        return chosen

    params.without_extra_buffers = True  # type: ignore[attr-defined]
    bindings.llama_model_default_params = params


def git_sha() -> str:
    """The commit measured; KVGEN_GIT_SHA names it where the tree is a copy (a GPU machine's)."""
    if os.environ.get("KVGEN_GIT_SHA"):
        return os.environ["KVGEN_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def model_label(model: str) -> str:
    """The model's name in results names: a short name as given, a .gguf path by its file's name."""
    return Path(model).stem if model.endswith(".gguf") else model


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    stamped = {"benchmark": name, "git_sha": git_sha(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine()}
    path.write_text(json.dumps(stamped | payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def quality_arguments(doc: str | None) -> Any:
    """The options both quality benchmarks take: which models, how many tokens of which play."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--play", default="hamlet")
    parser.add_argument("--name", default=None, help="results file name (default: the benchmark's)")
    return parser.parse_args()


def compared(exact: Any, scores: Any) -> dict[str, float]:
    """Perplexity, its change, KL divergence and top-1 agreement of `scores` against `exact`."""
    from kvgen.quality import kl_divergence, top1_agreement

    return {
        "perplexity": scores.perplexity,
        "delta_ppl_pct": 100 * (scores.perplexity / exact.perplexity - 1),
        "kld": kl_divergence(exact, scores),
        "top1_agreement": top1_agreement(exact, scores),
    }


def between_plain_runs(
    llm: Any, prompts: dict[str, Any], configs: Callable[[str], dict[str, Any]], params: Any, rounds: int
) -> tuple[dict[tuple[str, str], list[Any]], dict[tuple[str, str], list[float]]]:
    """Speculative runs taking turns with plain ones: each round, every method (`configs(task)`:
    name -> SpeculativeConfig) runs on each task between two plain runs of it, and its ratio is
    against the mean of those two, so a drift of the machine's speed within a round cancels; the
    methods' order rotates by round. -> (results per (task, method), plain runs under "plain";
    ratios per (task, method))."""
    samples: dict[tuple[str, str], list[Any]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for round_index in range(rounds):
        for task, prompt in prompts.items():
            methods = configs(task)
            names = list(methods)
            turn = round_index % len(names) if names else 0
            before = llm.generate(prompt, params)
            samples.setdefault((task, "plain"), []).append(before)
            for method in names[turn:] + names[:turn]:
                result = llm.generate(prompt, params, speculative=methods[method])
                after = llm.generate(prompt, params)
                samples.setdefault((task, method), []).append(result)
                samples[(task, "plain")].append(after)
                plain_speed = (before.timings.decode_tokens_per_second + after.timings.decode_tokens_per_second) / 2
                ratios.setdefault((task, method), []).append(result.timings.decode_tokens_per_second / plain_speed)
                before = after
    return samples, ratios
