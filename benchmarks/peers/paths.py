"""Where the peer engines' model exports live: <venv>/peers/<model>/<engine>, next to the packages
that read them, so `make clean` removes both together."""

from __future__ import annotations

import sys
from pathlib import Path

# The folder each export is written to, per engine (the HF folder is the source of the other three).
EXPORTS = {"hf": "hf-fp32", "ctranslate2": "ct2-int8", "openvino": "openvino-int4", "onnxruntime-genai": "ortgenai-int4"}


def peers_root() -> Path:
    return Path(sys.prefix) / "peers"


def export_dir(model: str, engine: str, root: Path | None = None) -> Path:
    return (root or peers_root()) / model / EXPORTS[engine]
