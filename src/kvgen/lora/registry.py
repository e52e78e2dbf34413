"""AdapterRegistry: the LoRA adapters one model serves, by name.

Adapters live in CPU RAM within an optional budget: loading past it evicts the least recently used
adapters that no request holds; an evicted adapter stays registered and is read from its file again
on its next use (vLLM's max_cpu_loras, by bytes). A request holds its adapter from admission to its
end (`acquire` / `release`); unloading a held adapter is deferred: new requests are refused at
once, the running ones finish with it, and it goes when the last one ends. Every change restacks the
weights under the model's forward lock, so a forward never sees half an update.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvgen.lora.adapter import AdapterError, LoraAdapter, UnknownAdapterError, projection_shapes
from kvgen.lora.gguf_lora import is_gguf_lora, load_gguf_lora
from kvgen.lora.peft_folder import is_peft_folder, load_peft_folder
from kvgen.models.granite_hybrid import HybridBlock
from kvgen.models.layers import Attention, GatedMLP, ReluSquaredMLP
from kvgen.models.lora import FUSED_MODULES, LoraStacks
from kvgen.models.moe import SparseMoE


def read_adapter(name: str, path: str | Path, config) -> LoraAdapter:  # config: ModelConfig
    """A PEFT folder or a GGUF LoRA file -> LoraAdapter checked against `config` (AdapterError)."""
    path = Path(path)
    if is_peft_folder(path):
        return load_peft_folder(name, path, config)
    if is_gguf_lora(path):
        return load_gguf_lora(name, path, config)
    raise AdapterError(f"no LoRA adapter at {path}: give a PEFT folder (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file")


@dataclass
class AdapterStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    loads: int = 0  # reads of its file (the first, and each after an eviction)


@dataclass
class _Entry:
    path: Path
    generation: int  # tells a reload under the same name apart (prefix-cache key)
    adapter: LoraAdapter | None  # None: evicted, read again on next use
    in_use: int = 0
    draining: bool = False  # unload asked while in use
    last_used: float = field(default_factory=time.monotonic)
    stats: AdapterStats = field(default_factory=AdapterStats)


def _takes_lora(block) -> bool:  # block: an nn.Module of model.layers
    """Whether every linear LoRA targets in `block` is one kvgen applies it to (see check_model)."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if isinstance(block, HybridBlock):  # its attention, mixer and dense MLP all take deltas; a mixture's are refused per adapter
        return True
    return isinstance(attn, Attention) and isinstance(mlp, GatedMLP | SparseMoE)


class AdapterRegistry:
    def __init__(self, model, budget_mb: float | None = None):  # model: DecoderLM
        self.model = model
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._generations = 0
        self.evictions = 0
        self.budget_bytes: int | None = None
        self.set_budget(budget_mb)

    def set_budget(self, budget_mb: float | None) -> None:
        """The most MiB of adapter weights kept in RAM (None: no limit); idle adapters past it are
        evicted now, least recently used first. ValueError for a budget that is not positive."""
        if budget_mb is not None and not (isinstance(budget_mb, (int, float)) and budget_mb > 0):
            raise AdapterError(f"the adapter memory budget must be a positive number of MiB, got {budget_mb!r}")
        with self._lock:
            self.budget_bytes = int(budget_mb * 2**20) if budget_mb is not None else None
            if self.budget_bytes is not None and self._evict_idle(keep=None):
                self._restack()

    @property
    def _out_sizes(self) -> dict[str, tuple[int, ...]]:
        """Output width of each projection a fused linear holds (0 for one no layer has: an ungated
        MLP's gate, a dense model's mixer). `check_model` has refused models LoRA does not reach."""
        config = self.model.config
        num_layers = len(self.model.layers)
        sizes = {p: out for layer in range(num_layers) for p, (out, _) in projection_shapes(config, layer).items()}
        return {fused: tuple(sizes.get(p, 0) for p in projs) for fused, projs in FUSED_MODULES.items()}

    def check_model(self) -> None:
        """AdapterError unless LoRA reaches every block: grouped-query attention + a gated MLP or a
        mixture of experts (whose experts take none, its attention does), or a hybrid's layer
        (attention, a Mamba-2 or short-conv mixer, a dense or ReLU² MLP or a mixture, as it has them)."""
        config = self.model.config
        architecture = config.architecture
        if architecture == "falcon_h1" and not config.folded_multipliers:
            raise AdapterError("LoRA adapters on a Falcon-H1 GGUF are not supported: its converter folded the µP multipliers into "
                               "the weights without recording them, and an adapter trained beside the unfolded projections needs "
                               "the same folding; load the model's HF folder (config.json gives them) to run adapters")  # fmt: skip
        blocks = getattr(self.model, "layers", None)
        if blocks is None or not all(_takes_lora(block) for block in blocks):
            raise AdapterError(f"LoRA adapters are not supported for {architecture} models")

    # -- loading -----------------------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check the adapter, then serve it as `name`. AdapterError when the name is taken
        or the file does not fit the model; nothing changes then."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise AdapterError(f"an adapter name must be a non-empty string without surrounding spaces, got {name!r}")
        self.check_model()
        with self._lock:
            if name in self._entries:
                raise AdapterError(f"an adapter named {name!r} is loaded already: unload it first or pick another name")
        adapter = read_adapter(name, path, self.model.config)  # slow part outside the lock
        with self._lock:
            if name in self._entries:
                raise AdapterError(f"an adapter named {name!r} is loaded already: unload it first or pick another name")
            self._generations += 1
            entry = _Entry(Path(path), self._generations, adapter)
            entry.stats.loads = 1
            self._entries[name] = entry
            try:
                self._fit_budget(keep=name)
            except AdapterError:
                del self._entries[name]
                raise
            self._restack()
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving `name`: True when it is gone now, False when requests hold it (it goes when
        the last ends; new requests for it are refused from now)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.draining:
                raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
            if entry.in_use:
                entry.draining = True
                return False
            del self._entries[name]
            self._restack()
            return True

    # -- requests ----------------------------------------------------------------------------------
    def cache_key(self, name: str) -> str:
        """What joins the prefix-cache key of a request under `name`: blocks computed with one
        adapter (or one load of it) are never reused for another."""
        with self._lock:
            entry = self._live(name)
            return f"lora:{name}#{entry.generation}"

    def check(self, name: str) -> None:
        """UnknownAdapterError unless `name` is loaded and accepting requests."""
        with self._lock:
            self._live(name)

    def acquire(self, name: str, count: bool = True) -> str:
        """Hold `name` for one request (reads it again if it was evicted); its cache key. `count`:
        the hold is a request of its own (False: work for a request counted already, e.g. the
        server scoring an echoed prompt)."""
        with self._lock:
            entry = self._live(name)
            if entry.adapter is None:
                entry.adapter = read_adapter(name, entry.path, self.model.config)
                try:
                    self._fit_budget(keep=name)
                except AdapterError:
                    entry.adapter = None
                    raise
                entry.stats.loads += 1
                self._restack()
            entry.in_use += 1
            entry.last_used = time.monotonic()
            entry.stats.requests += count
            return f"lora:{name}#{entry.generation}"

    def release(self, name: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.in_use -= 1
            entry.stats.prompt_tokens += prompt_tokens
            entry.stats.generated_tokens += generated_tokens
            if entry.draining and entry.in_use == 0:
                del self._entries[name]
                self._restack()

    def _live(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None or entry.draining:
            loaded = ", ".join(self.names()) or "none"
            raise UnknownAdapterError(f"adapter {name!r} is not loaded (loaded: {loaded})")
        return entry

    # -- memory ------------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of the adapters' weights in RAM (the loaded ones not evicted, and the unloading ones)."""
        with self._lock:
            return sum(e.adapter.nbytes for e in self._entries.values() if e.adapter is not None)

    def _fit_budget(self, keep: str) -> None:
        """Evict idle adapters, least recently used first, until the resident ones fit the budget.
        AdapterError, evicting nothing, when `keep` and the adapters in use cannot fit together."""
        if self.budget_bytes is None:
            return
        pinned = sum(e.adapter.nbytes for n, e in self._entries.items() if e.adapter is not None and (n == keep or e.in_use))
        if pinned > self.budget_bytes:
            raise AdapterError(f"adapter {keep!r} does not fit the adapter memory budget "
                               f"({self.budget_bytes / 2**20:.1f} MiB) beside the adapters in use: raise the budget")  # fmt: skip
        self._evict_idle(keep)

    def _evict_idle(self, keep: str | None) -> int:
        """Evict idle resident adapters other than `keep`, least recently used first, until the
        resident ones fit the budget (they stay registered); how many went."""
        idle = sorted((e.last_used, n) for n, e in self._entries.items() if n != keep and e.in_use == 0 and e.adapter is not None)
        evicted = 0
        for _, name in idle:
            if self.resident_bytes() <= self.budget_bytes:
                break
            self._entries[name].adapter = None
            self.evictions += 1
            evicted += 1
        return evicted

    def _restack(self) -> None:
        """Stack the resident adapters into the model's linears (under its forward lock)."""
        resident = [(n, e.adapter.weights) for n, e in self._entries.items() if e.adapter is not None]
        with self.model._forward_lock:
            if not resident:
                self._attach(None)
                return
            stacks = self.model.lora if self.model.lora is not None else LoraStacks(self._out_sizes)
            stacks.rebuild(resident)
            self._attach(stacks)

    def _attach(self, stacks: LoraStacks | None) -> None:
        for i, block in enumerate(self.model.layers):
            if block.attn is not None:
                block.attn.lora, block.attn.lora_layer = stacks, i
            if isinstance(block.mlp, GatedMLP | ReluSquaredMLP):  # a mixture's experts take no adapter (build_adapter)
                block.mlp.lora, block.mlp.layer = stacks, i
            if getattr(block, "mixer", None) is not None:  # a hybrid's state layer
                block.mixer.lora, block.mixer.layer = stacks, i
        self.model.lora = stacks

    # -- introspection -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Adapters accepting requests, in load order."""
        with self._lock:
            return [n for n, e in self._entries.items() if not e.draining]

    def info(self) -> dict[str, dict]:
        """Per adapter: path, rank, projections, resident bytes, in-use count and counters (metrics)."""
        with self._lock:
            out = {}
            for name, e in self._entries.items():
                a = e.adapter
                out[name] = {
                    "path": str(e.path), "resident": a is not None, "bytes": a.nbytes if a else 0,
                    "rank": a.rank if a else None, "projections": list(a.projections) if a else None,
                    "in_use": e.in_use, "unloading": e.draining, **vars(e.stats),
                }  # fmt: skip
            return out
