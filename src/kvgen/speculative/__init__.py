"""Speculative decoding: proposers guess tokens, the target verifies them in one forward."""

from kvgen.speculative.adaptive import SpeculativeStats
from kvgen.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig", "SpeculativeStats"]
