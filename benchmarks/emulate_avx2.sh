#!/bin/sh
# Runs a benchmark command with every engine that can be held to AVX2 held to it, so that an
# AVX-512 machine measures the paths an AVX2-only CPU takes (the results are named
# "<class>-on-<this CPU's class>", never the AVX2 machine's own tables):
#   kvgen      its kernels built for KVGEN_KERNEL_ARCH (default znver3: the AVX2 EPYC's own target)
#   torch      its own kernels (ATEN_CPU_CAPABILITY), MKL and oneDNN capped at AVX2 (transformers)
#   CTranslate2  CT2_FORCE_CPU_ISA=AVX2, its oneDNN GEMMs capped as torch's are
#   llama.cpp  an AVX2-only build of llama-cpp-python (`make .venv/llama-avx2`) ahead on PYTHONPATH
# OpenVINO GenAI and ONNX Runtime GenAI choose their instruction set themselves: decode.py refuses
# them here. Zen 4 runs 256-bit code at about Zen 3's width per clock, but its clock, caches and
# memory differ: an emulated ratio is evidence, not the AVX2 machine's measurement.
#   sh benchmarks/emulate_avx2.sh python benchmarks/decode.py --peers transformers,llama.cpp
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
export KVGEN_KERNEL_ARCH="${KVGEN_KERNEL_ARCH:-znver3}"
export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 CT2_FORCE_CPU_ISA=AVX2
if [ -d "$root/.venv/llama-avx2" ]; then
    export PYTHONPATH="$root/.venv/llama-avx2${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$@"
