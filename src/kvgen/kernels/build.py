"""Compiling qgemm.c for this machine (gcc -O3 -march=native -fopenmp) and loading it with ctypes.

The library is cached under ~/.cache/kvgen/kernels keyed by the source, the flags and the CPU's
feature flags, so a second run loads it in milliseconds and a different CPU gets its own build.
No compiler -> `load()` returns None and kvgen keeps fp32 weights (with the reason in `last_error`).

KVGEN_KERNEL_ARCH=<gcc -march target> builds for an older instruction set than the machine's own,
e.g. `znver3` or `x86-64-v3` on an AVX-512 machine runs the AVX2 paths an AVX2-only CPU takes (to
measure or debug them); a target that needs instructions this CPU lacks is refused.
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
# Every C file beside qgemm.c (which #includes them) keys the cached library: a list by hand had
# missed a new file, and a stale library ran with its edits absent.
SOURCES = sorted(SOURCE.parent.glob("*.c"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ARCH_VARIABLE = "KVGEN_KERNEL_ARCH"
# The x86 instruction sets the kernels test for, as gcc's macros and /proc/cpuinfo's flags.
ISA_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVX512F__": "avx512f",
              "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl", "__AVX512VNNI__": "avx512_vnni",
              "__AVX512BF16__": "avx512_bf16", "__AVXVNNI__": "avx_vnni", "__AVX512FP16__": "avx512_fp16",
              "__AMX_TILE__": "amx_tile"}  # fmt: skip
last_error: str | None = None


def _cpuinfo_line(*keys: str) -> str | None:
    """The first /proc/cpuinfo line that starts with one of keys, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return _cpuinfo_line("flags", "Features") or platform.processor()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), or "" where it has none."""
    line = _cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def tuning_flags() -> tuple[str, ...]:
    """Defines that only change speed, by vendor. The int8 attention asks for its K/V codes ahead
    (group_tiles.c, CODES_PREFETCH_BYTES): 1.45x as fast on an Intel Xeon, where on a Zen 4 EPYC the
    hardware prefetchers followed those streams and asking ahead made a layer 13-60% slower. A block
    of rows scores a shared tile from its keys transposed once (transposed_scores.c): on the Intel
    Xeon a gain, on the Zen 4 EPYC a loss (SmolLM2's 8-token forward after 2,048 positions 1.12x
    as fast without it, its 512-token prompt 1.05x; Gemma 3 within noise)."""
    return ("-DCODES_PREFETCH_BYTES=0", "-DNO_TRANSPOSED_SCORES") if cpu_vendor() == "AuthenticAMD" else ()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo names them."""
    return frozenset(_cpu_flags().split())


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) found")
    return compiler


def kernel_arch() -> str | None:
    """KVGEN_KERNEL_ARCH's target, or None for the machine's own (-march=native)."""
    arch = os.environ.get(ARCH_VARIABLE, "").strip()
    return None if arch in ("", "native") else arch


@cache
def _target_isa(arch: str) -> frozenset[str]:
    """The /proc/cpuinfo flags of the instruction sets gcc's `arch` target enables (ISA_MACROS);
    ValueError if gcc does not know the target or it needs one this CPU lacks."""
    result = subprocess.run([_compiler(), f"-march={arch}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr.strip().splitlines() or [""])[0][:200]  # one line: gcc goes on to list every target
        raise ValueError(f"{ARCH_VARIABLE}={arch!r} is not a target the C compiler knows ({said}); "
                         "unset it or name a gcc -march target such as x86-64-v3")  # fmt: skip
    defined = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}
    isa = frozenset(flag for macro, flag in ISA_MACROS.items() if macro in defined)
    missing = sorted(isa - cpu_flags())
    if missing:
        raise ValueError(f"{ARCH_VARIABLE}={arch!r} needs {', '.join(missing)}, which this CPU lacks (the kernels "
                         f"would stop on an illegal instruction); unset it or name an older target such as x86-64-v3")  # fmt: skip
    return isa


def kernel_isa() -> frozenset[str]:
    """The instruction-set flags (as /proc/cpuinfo names them) the kernels are built for."""
    arch = kernel_arch()
    return cpu_flags() if arch is None else _target_isa(arch)


def kernel_flags() -> tuple[str, ...]:
    """FLAGS, with KVGEN_KERNEL_ARCH's target in place of -march=native when it is set."""
    arch = kernel_arch()
    if arch is None:
        return (*FLAGS, *tuning_flags())
    _target_isa(arch)  # refuses a target gcc does not know or this CPU cannot run
    return (*(f"-march={arch}" if flag == "-march=native" else flag for flag in FLAGS), *tuning_flags())


def library_path() -> Path:
    root = Path(os.environ.get("KVGEN_CACHE", Path.home() / ".cache" / "kvgen")) / "kernels"
    sources = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(sources + " ".join(kernel_flags()).encode() + _cpu_flags().encode()).hexdigest()[:16]
    return root / f"qgemm-{key}.so"


def build(target: Path, flags: list[str] | tuple[str, ...] | None = None) -> None:
    """Compile the kernels into `target` (flags: another instruction set, for tests that compare
    them; by default kernel_flags())."""
    compiler = _compiler()
    flags = kernel_flags() if flags is None else flags
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

    try:
        target = library_path()  # ValueError (a KVGEN_KERNEL_ARCH this CPU cannot run) is raised
        if not target.exists():
            build(target)
        return open_library(target)
    except (OSError, RuntimeError) as error:
        last_error = str(error)
        return None


def amx_tiles(on: bool | None = None) -> bool:
    """Whether the quantized matmuls run 16 or more rows (q4, q4h, q5: 32) in Intel's AMX tiles
    (amx_tiles.c: CPUs with AMX, where Linux grants the tile state; on by default there). `on` turns
    them on or off first, e.g. to compare the two paths, whose bits are the same."""
    library = load()
    if library is None:
        return False
    return bool(library.kvgen_amx_set(-1 if on is None else int(on)))


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' signatures."""
    library = ctypes.CDLL(str(path))
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    library.kvgen_quantize_x8.argtypes = [pointer, count, count, pointer]
    kinds = ("q4x8", "q4hx8", "q8x8", "q8sx8", "q5x8", "q4kx8", "q6kx8", "iq4x8", "q5mx8", "mx4x8")
    for name in (f"kvgen_gemm_{kind}" for kind in kinds):
        getattr(library, name).argtypes = [pointer, pointer, pointer, count, count, count]
    for name in (f"kvgen_repack_{kind}" for kind in kinds):
        getattr(library, name).argtypes = [pointer, pointer, count, count]
    for name in (f"kvgen_linear_{kind}" for kind in kinds):
        getattr(library, name).argtypes = [pointer, pointer, pointer, pointer, count, count, count]
    dequantizers = [f"kvgen_dequantize_{kind}{suffix}" for kind in kinds for suffix in ("", "_bf16")]
    for name in dequantizers:
        getattr(library, name).argtypes = [pointer, pointer, count, count]
    for name in ("kvgen_linear_f16", "kvgen_linear_bf16"):
        getattr(library, name).argtypes = [pointer, pointer, pointer, count, count, count]
    library.kvgen_widen_bf16_pairs.argtypes = [pointer, pointer, count, count]
    for name in ("kvgen_gemm_bf16_rows", "kvgen_gemm_f16_rows"):
        getattr(library, name).argtypes = [pointer, pointer, pointer, count, count, count]
        getattr(library, name).restype = ctypes.c_int32
    library.kvgen_bf16_gemm_built.restype = ctypes.c_int32
    library.kvgen_half_row_pairs_built.restype = ctypes.c_int32
    library.kvgen_rms_norm_rows.argtypes = [pointer, pointer, ctypes.c_float, count, count, pointer]
    library.kvgen_gated_rows.argtypes = [pointer, count, count, ctypes.c_int32, pointer]
    library.kvgen_argmax_f32.argtypes = [pointer, count]
    library.kvgen_argmax_f32.restype = count
    library.kvgen_amx_set.argtypes = [ctypes.c_int]
    library.kvgen_amx_set.restype = ctypes.c_int
    library.kvgen_rope.argtypes = [pointer] + [count] * 7 + [pointer, pointer, count, pointer]
    library.kvgen_lora_delta.argtypes = [pointer, count, count, pointer, pointer, count, pointer]
    library.kvgen_block_pre.argtypes = [pointer] * 7 + [count]
    library.kvgen_block_pre_into.argtypes = [pointer] * 6 + [count, pointer, count]
    library.kvgen_block_mlp.argtypes = [pointer, pointer, pointer, count]
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
    library.kvgen_eagle_position.argtypes = [pointer, pointer, pointer, ctypes.c_float, pointer, pointer, pointer, pointer,
                                             pointer, pointer, pointer, pointer, count, count, count, pointer]  # fmt: skip
    library.kvgen_eagle_positions.argtypes = [pointer, pointer, pointer, ctypes.c_float, pointer, pointer, count, pointer,
                                              pointer, pointer, pointer, pointer, pointer, count, count, count, pointer,
                                              pointer, pointer, pointer]  # fmt: skip
    library.kvgen_mamba_step.argtypes = [pointer, count, count] + [pointer] * 5
    library.kvgen_mamba2_step_from.argtypes = [pointer, count, count] + [pointer] * 9
    library.kvgen_mamba2_replay.argtypes = [pointer, count] + [pointer] * 3
    library.kvgen_short_conv_step.argtypes = [pointer, count] + [pointer] * 5
    library.kvgen_hybrid_rows.argtypes = ([pointer, count, count, pointer, pointer, count, pointer, pointer, count] + [pointer] * 7
                                          + [count, pointer, pointer])  # fmt: skip
    library.kvgen_hybrid_step.argtypes = [pointer, count, pointer, pointer, count] + [pointer] * 4 + [count] * 4 + [pointer] * 5 + [count]
    library.kvgen_causal_conv.argtypes = [pointer] * 3 + [count] * 4 + [ctypes.c_int32, pointer]
    library.kvgen_gated_norm_rows.argtypes = [pointer] * 3 + [count] * 3 + [ctypes.c_float]
    library.kvgen_selective_scan.argtypes = [pointer] * 9 + [count] * 3 + [pointer, count, pointer]
    library.kvgen_ssd_scan.argtypes = [pointer] * 7 + [count, pointer, pointer] + [count] * 5 + [pointer, count, pointer]
    library.kvgen_eagle_logits.argtypes = [pointer, pointer, ctypes.c_float, pointer, pointer, pointer, pointer]
    library.kvgen_decode_rows.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer, pointer,
                                          pointer, count, count, count, count, count, pointer, count, pointer, pointer,
                                          pointer, pointer, pointer, pointer]  # fmt: skip
    # blocks, num_layers, rows, h, rope, rope kinds, rope_kind, window, row_stores, pos_stride, positions, scratch, lora, slots
    library.kvgen_decode_rows_own.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer, pointer,
                                              count, pointer, pointer, pointer, pointer]  # fmt: skip
    library.kvgen_mlp_rows.argtypes = [pointer, count, pointer, pointer, pointer, pointer]
    library.kvgen_vocab_splits.argtypes = [pointer, pointer, count, pointer, pointer, count, ctypes.c_int32, pointer, pointer,
                                          pointer, count]  # fmt: skip
    library.kvgen_vocab_splits.restype = count
    library.kvgen_decode_tree.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer, pointer,
                                          pointer, count, count, count, count, count, pointer, pointer, count, count,
                                          pointer, pointer]  # fmt: skip
    library.kvgen_paged_codes_attention.argtypes = [pointer, pointer, count, pointer, pointer, count, count, count,
                                                    ctypes.c_float, count, pointer, pointer, count, pointer, count,
                                                    pointer, pointer, pointer, pointer]  # fmt: skip
    library.kvgen_decode_rows_over_codes.argtypes = [pointer, count, count, pointer, pointer, count, pointer, pointer,
                                                     pointer, pointer, count, count, count, count, pointer, pointer,
                                                     pointer, pointer, pointer, count, pointer, pointer, pointer, pointer,
                                                     pointer]  # fmt: skip
    for name in ("kvgen_rms_norm_rows", "kvgen_gated_rows", "kvgen_rope", "kvgen_paged_codes_attention", "kvgen_decode_rows_over_codes", "kvgen_decode_layers_over_codes", "kvgen_quantized_decode_attention", "kvgen_decode_layers", "kvgen_decode_rows", "kvgen_decode_rows_own", "kvgen_mlp_rows", "kvgen_eagle_positions", "kvgen_decode_tree", "kvgen_paged_decode_attention", "kvgen_decode_attention", "kvgen_block_pre", "kvgen_block_post", "kvgen_lora_delta", "kvgen_quantize_x8",
                 *(f"kvgen_{op}_{kind}" for op in ("gemm", "repack", "linear") for kind in kinds), *dequantizers):  # fmt: skip
        getattr(library, name).restype = None
    return library
