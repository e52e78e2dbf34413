"""Choosing the next token: parameters, processors, stop strings, grammar constraints, the sampler."""

from kvgen.sampling.grammar import GrammarConstraint, StructuredOutput, TokenConstraint
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import Sampler, TokenLogprob
from kvgen.sampling.stops import StopStringMatcher

__all__ = [
    "GrammarConstraint", "Sampler", "SamplingParams", "StopStringMatcher", "StructuredOutput", "TokenConstraint", "TokenLogprob",
]  # fmt: skip
