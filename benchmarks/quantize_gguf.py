"""Writes a model's GGUF re-quantized by llama.cpp's own llama-quantize (through llama-cpp-python,
a benchmark dependency), for formats no installable model ships in, such as IQ4_XS and IQ4_NL:

    python benchmarks/quantize_gguf.py --model smollm2 --type IQ4_XS
    python benchmarks/decode.py --model <the path it prints> --weights q4,int8 --peers llama.cpp --name decode-iq4_xs

The file goes to <venv>/peers/<model>/<model>-<type>.gguf. The source is the installed GGUF (for
SmolLM2 its Q4_1 blocks, so the new file's weights are a second rounding of those). Rows that are
not whole 256-weight super-blocks fall back to another type, as llama-quantize decides.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import model_label  # noqa: E402
from peers.paths import peers_root  # noqa: E402

from kvgen.loading.registry import resolve_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a known model's name or a .gguf path")
    parser.add_argument("--type", default="IQ4_XS", help="llama.cpp's file type name, e.g. IQ4_XS, IQ4_NL, Q4_K_M")
    args = parser.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        parser.error(f"llama.cpp has no file type {args.type!r}")
    source = resolve_model_path(args.model)
    label = model_label(args.model).rsplit("-", 1)[0] if args.model.endswith(".gguf") else args.model  # a file: its stem less its type
    out = peers_root() / label / f"{label}-{args.type.lower()}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama-quantize could not write {out}")
    print(out)


if __name__ == "__main__":
    main()
