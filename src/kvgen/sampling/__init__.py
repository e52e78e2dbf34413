"""Choosing the next token: parameters, and the sampler that applies them."""

from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import Sampler

__all__ = ["Sampler", "SamplingParams"]
