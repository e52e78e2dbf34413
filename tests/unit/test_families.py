"""`kvgen models` lists every family kvgen builds, with what each supports."""

from __future__ import annotations

from kvgen.config import ENCODER_DECODER_ARCHITECTURES, STATE_SPACE_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from kvgen.families import FAMILY_SUPPORT, family_table
from kvgen.models import FAMILIES


def test_every_architecture_has_a_class_and_a_support_line() -> None:
    assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES + STATE_SPACE_ARCHITECTURES + ENCODER_DECODER_ARCHITECTURES)
    listed = " ".join(f.name for f in FAMILY_SUPPORT)
    for architecture in FAMILIES:
        assert architecture in listed, architecture
    table = family_table()
    assert all(f.name in table and f.c_decode in table for f in FAMILY_SUPPORT)
