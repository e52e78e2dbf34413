"""LoRA adapters served per request on one base model (see docs/lora.md)."""

from kvgen.lora.adapter import AdapterError, LoraAdapter, UnknownAdapterError
from kvgen.lora.registry import AdapterRegistry, read_adapter

__all__ = ["AdapterError", "AdapterRegistry", "LoraAdapter", "UnknownAdapterError", "read_adapter"]
