"""Compiling qgemm.c for this machine (gcc -O3 -march=native -fopenmp) and loading it with ctypes.

The library is cached under ~/.cache/kvgen/kernels keyed by the source, the flags and the CPU's
feature flags, so a second run loads it in milliseconds and a different CPU gets its own build.
No compiler -> `load()` returns None and kvgen keeps fp32 weights (with the reason in `last_error`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCE = Path(__file__).with_name("qgemm.c")
INCLUDED = ("interleaved.c", "interleaved_pairs.c", "k_quants.c", "decode.c", "attention_tiles.c", "quantized_attention.c", "group_tiles.c", "int4_tiles.c", "paged_codes_attention.c", "decode_rows.c", "lora_delta.c", "rows_ops.c")  # #included by qgemm.c
SOURCES = [SOURCE, *(Path(__file__).with_name(name) for name in INCLUDED)]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
last_error: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    root = Path(os.environ.get("KVGEN_CACHE", Path.home() / ".cache" / "kvgen")) / "kernels"
    sources = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(sources + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    return root / f"qgemm-{key}.so"


def build(target: Path, flags: list[str] = FLAGS) -> None:
    """Compile the kernels into `target` (flags: another instruction set, for tests that compare them)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: a concurrent process sees the old file or the new one


@cache
def load() -> ctypes.CDLL | None:
    global last_error
    import torch  # noqa: F401  load torch's libgomp first so the kernels share its thread pool

    target = library_path()
    try:
        if not target.exists():
            build(target)
        return open_library(target)
    except (OSError, RuntimeError) as error:
        last_error = str(error)
        return None


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' signatures."""
    library = ctypes.CDLL(str(path))
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    library.kvgen_quantize_x8.argtypes = [pointer, count, count, pointer]
    kinds = ("q4x8", "q8x8", "q8sx8", "q5x8", "q4kx8", "q6kx8")
    for name in (f"kvgen_gemm_{kind}" for kind in kinds):
        getattr(library, name).argtypes = [pointer, pointer, pointer, count, count, count]
    for name in (f"kvgen_repack_{kind}" for kind in kinds):
        getattr(library, name).argtypes = [pointer, pointer, count, count]
    for name in (f"kvgen_linear_{kind}" for kind in kinds):
        getattr(library, name).argtypes = [pointer, pointer, pointer, pointer, count, count, count]
    dequantizers = [f"kvgen_dequantize_{kind}{suffix}" for kind in kinds for suffix in ("", "_bf16")]
    for name in dequantizers:
        getattr(library, name).argtypes = [pointer, pointer, count, count]
    library.kvgen_rms_norm_rows.argtypes = [pointer, pointer, ctypes.c_float, count, count, pointer]
    library.kvgen_swiglu_rows.argtypes = [pointer, count, count, pointer]
    library.kvgen_argmax_f32.argtypes = [pointer, count]
    library.kvgen_argmax_f32.restype = count
    library.kvgen_rope.argtypes = [pointer] + [count] * 7 + [pointer, pointer, count, pointer]
    library.kvgen_lora_delta.argtypes = [pointer, count, count, pointer, pointer, count, pointer]
    library.kvgen_block_pre.argtypes = [pointer] * 7 + [count]
    library.kvgen_paged_decode_attention.argtypes = [pointer] * 4 + [count] * 4 + [ctypes.c_float] + [count] * 4 + [pointer, count, pointer, pointer]
    library.kvgen_decode_attention.argtypes = [pointer] * 4 + [count] * 3 + [ctypes.c_float] + [count] * 4
    library.kvgen_block_post.argtypes = [pointer, pointer, pointer, count, count, pointer, count, count, count, count,
                                         pointer, count]  # fmt: skip
    library.kvgen_quantized_decode_attention.argtypes = [pointer, pointer, count, count, count, ctypes.c_float, pointer,
                                                         pointer, count, count, pointer, pointer, count, count, pointer,
                                                         pointer, count, count, count]  # fmt: skip
    library.kvgen_decode_layers_over_codes.argtypes = [pointer, count, pointer, pointer, pointer, pointer, pointer,
                                                       count, count, pointer, count]  # fmt: skip
    library.kvgen_decode_layers.argtypes = [pointer, count, pointer, pointer, pointer, pointer, pointer, pointer,
                                            count, count, count, count, count, pointer, count, pointer, count]  # fmt: skip
    library.kvgen_decode_rows.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer, pointer,
                                          pointer, count, count, count, count, count, pointer, count, pointer, pointer,
                                          pointer, pointer, pointer, pointer]  # fmt: skip
    library.kvgen_paged_codes_attention.argtypes = [pointer, pointer, count, pointer, pointer, count, count, count,
                                                    ctypes.c_float, count, pointer, pointer, count, pointer, count,
                                                    pointer, pointer, pointer, pointer]  # fmt: skip
    library.kvgen_decode_rows_over_codes.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer,
                                                     pointer, pointer, count, count, count, count, pointer, pointer,
                                                     pointer, pointer, pointer, count, pointer, pointer, pointer, pointer,
                                                     pointer]  # fmt: skip
    for name in ("kvgen_rms_norm_rows", "kvgen_swiglu_rows", "kvgen_rope", "kvgen_paged_codes_attention", "kvgen_decode_rows_over_codes", "kvgen_decode_layers_over_codes", "kvgen_quantized_decode_attention", "kvgen_decode_layers", "kvgen_decode_rows", "kvgen_paged_decode_attention", "kvgen_decode_attention", "kvgen_block_pre", "kvgen_block_post", "kvgen_lora_delta", "kvgen_quantize_x8",
                 *(f"kvgen_{op}_{kind}" for op in ("gemm", "repack", "linear") for kind in kinds), *dequantizers):  # fmt: skip
        getattr(library, name).restype = None
    return library
