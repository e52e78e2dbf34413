"""What the state-space families share: the forward contract over SSMStateCaches (ragged rows, each
continuing its own state; states captured at checkpoint multiples and committed at the end), the
causal convolution step over a held window of inputs, and where to capture.

A subclass builds `embed_tokens`, `layers` (blocks with a `norm` and a `mixer`), `norm`, `lm_head`
and says its state shapes (`state_spec`); a mixer maps (x [B, S, H], conv state, recurrent state,
capture points per row) to (output [B, S, H], per row the (conv, recurrent) states after each point).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import load
from kvgen.kv.ssm import SSMSpec, SSMStateCache
from kvgen.models.layers import RMSNorm
from kvgen.models.lora import LoraStacks, refuse_adapters
from kvgen.models.mamba_decode import StateStep, runs_in_c
from kvgen.models.weights import WeightSource, frozen, linear

# Passes of at most this many tokens run as a chain in C where the C step runs (`_steps_in_c`): a
# speculative verify (at most 7 drafts and the last token) and short turns. Each row's states are
# held until the commit, so longer prompts take the scan.
CHAIN_ROWS = 8
CHECKPOINT_BYTES = 2**30  # what a session's checkpoints may hold by default (Mamba-Codestral-7B: 3 states)
Captured = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per row, per capture point: (conv, recurrent)


def capture_points(cache: SSMStateCache, num_tokens: int) -> list[int]:
    """Positions (in this pass) after which to keep the state: checkpoint multiples, and the last.
    Only the latest `max_checkpoints` multiples: the commit would drop older ones, and a long
    prompt would otherwise hold a state per multiple until then (a Codestral state is 266 MiB).
    Every position under the cache's keep_positions (a speculative verify: a few tokens)."""
    if cache.keep_positions:
        return list(range(num_tokens))
    every, start = cache.checkpoint_every, cache.seq_len
    points = [p - start - 1 for p in range(start // every * every + every, start + num_tokens, every)]
    return [*points[-cache.max_checkpoints :], num_tokens - 1]


def commit_chain(cache: SSMStateCache, states: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Commit a chain's pass: states[r][layer], each layer's (conv, recurrent) state after row r
    (fresh tensors only this pass holds); the last row's become the cache's, and those after the
    positions `capture_points` asks for are kept (a speculative verify: every one)."""
    length = len(states)
    for layer, (conv, recurrent) in enumerate(states[-1]):
        cache.write(layer, conv, recurrent, owned=True)
    cache.commit(length, {point + 1: states[point] for point in capture_points(cache, length) if point < length - 1})


def causal_conv(
    conv_state: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (+ SiLU; LFM2's short conv has none) of inputs [B, C, S] after the held
    window conv_state [B, C, K] (the last K inputs) -> (output [B, C, S], the extended window
    [B, C, K-1+S] to take states from). On the CPU in fp32 the C kernel computes each position as
    the decode step does (kernels/mamba_step.c's kvgen_causal_conv), so a prompt's states have the
    bits of decoding it token by token: what a prefix hit, a session or a speculative verify resumes
    from is the state plain decoding would hold."""
    extended = torch.cat([conv_state[:, :, 1:], inputs], dim=2)  # the conv sees the held inputs first
    library = load() if extended.device.type == "cpu" else None
    if library is not None and extended.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
        extended = extended.contiguous()
        rows, channels, kernel = extended.shape[0], extended.shape[1], weight.shape[-1]
        taps, shift = weight.reshape(channels, kernel).contiguous(), bias.contiguous() if bias is not None else None
        out = torch.empty(rows, channels, inputs.shape[2])
        library.kvgen_causal_conv(extended.data_ptr(), taps.data_ptr(), shift.data_ptr() if shift is not None else None, rows,
                                  channels, kernel, inputs.shape[2], int(silu), out.data_ptr())  # fmt: skip
        return out, extended
    out = F.conv1d(extended, weight, bias, groups=inputs.shape[1])
    return (F.silu(out) if silu else out), extended


def conv_state_after(extended: torch.Tensor, row: int, position: int, kernel: int) -> torch.Tensor:
    """Row `row`'s conv state after `position` of the pass: its last `kernel` inputs up to it [1, C, K]."""
    return extended[row : row + 1, :, position : position + kernel].clone()


class SSMBlock(nn.Module):
    """A state-space layer of Mamba's and Mamba-2's checkpoints (`backbone.layers.N`): an RMSNorm, then the mixer."""

    def __init__(self, config: Any, layer: int, weights: WeightSource, mixer: Callable[[Any, WeightSource, str], nn.Module]):
        super().__init__()
        prefix = f"backbone.layers.{layer}"
        self.norm = RMSNorm(weights.take_tensor(f"{prefix}.norm.weight"), config.rms_norm_eps)
        self.mixer = mixer(config, weights, f"{prefix}.mixer")


class RecurrentLM(nn.Module):
    """forward(input_ids, cache) like DecoderLM's, over an SSMStateCache instead of a KV cache."""

    use_fast_decode = False  # the attention blocks' C path; short rows run _steps_in_c instead
    c_decode = True  # False: one token per row runs the torch step too (the reference the C step is tested against)
    embed_tokens: nn.Parameter
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    lora: LoraStacks | None = None  # the loaded LoRA adapters' weights, where the family takes them (hybrids)

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self._forward_lock = threading.Lock()
        self._step: Any = None  # the C decode step (_c_step)

    def state_spec(self, batch: int = 1) -> SSMSpec:
        raise NotImplementedError

    def _load_backbone(self, weights: WeightSource, mixer: Callable[[Any, WeightSource, str], nn.Module]) -> None:
        """Mamba's and Mamba-2's checkpoints: `backbone.*` layers of `mixer`, the head tied to the
        embedding where the checkpoint has none and the config ties them."""
        config = self.config
        self.embed_tokens = frozen(weights.take_tensor("backbone.embeddings.weight"))  # [V, H]
        self.layers = nn.ModuleList([SSMBlock(config, i, weights, mixer) for i in range(config.num_layers)])
        self.norm = RMSNorm(weights.take_tensor("backbone.norm_f.weight"), config.rms_norm_eps)
        tied = config.tie_word_embeddings and not weights.has("lm_head.weight")
        self.lm_head = linear(self.embed_tokens.data if tied else weights.take("lm_head.weight"))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """The CPU: these families run there only (models/device.py refuses to move them)."""
        return self.embed_tokens.device

    def fast_decoder(self) -> None:
        return None

    def new_state_cache(self, checkpoint_every: int = 64, max_checkpoints: int | None = None) -> SSMStateCache:
        """max_checkpoints None: 32, or as many as CHECKPOINT_BYTES holds where states are large."""
        spec = self.state_spec()
        if max_checkpoints is None:
            max_checkpoints = max(1, min(32, CHECKPOINT_BYTES // spec.bytes_per_snapshot))
        return SSMStateCache(spec, checkpoint_every, max_checkpoints)

    def forward(
        self, input_ids: torch.Tensor, cache: SSMStateCache, positions: torch.Tensor | None = None, logits_to_keep: int | None = 1,
        adapter: str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """input_ids [1, S] after cache.seq_len tokens -> logits [1, logits_to_keep or S, V]; the
        state after them is committed to `cache` (with checkpoints passed on the way)."""
        name = self.config.architecture
        if positions is not None:
            raise ValueError(f"{name} has no positions: its state orders the tokens; call without positions")
        if input_ids.shape[0] != 1:
            raise ValueError(f"forward takes one row (got {input_ids.shape[0]}); use forward_batch for several caches")
        logits = self.forward_batch(input_ids.tolist(), [cache], [logits_to_keep or input_ids.shape[1]], [adapter])
        return logits[None]  # [1, S', V]

    def forward_batch(
        self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int] | None = None,
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Ragged rows, each continuing its own cache, in one pass (padded on the right; each row's
        state is taken at its own last token) -> logits of each row's last num_logits[i] tokens [sum, V].
        `adapters`: per row the loaded LoRA adapter it runs with (None: the base model), where the
        family takes adapters (hybrids: models/granite_hybrid.py)."""
        if adapters is not None and len(adapters) != len(token_ids):
            raise ValueError(f"adapters needs one entry per row (None for the base model), got {len(adapters)} for {len(token_ids)} rows")
        if len(token_ids) != len(caches) or not caches or any(len(ids) == 0 for ids in token_ids):
            raise ValueError("forward_batch needs one cache per row and at least one token in every row")
        if not all(isinstance(c, SSMStateCache) for c in caches):
            raise ValueError(f"a {self.config.architecture} model keeps its state in an SSMStateCache (model.new_state_cache()), "
                             "not a KV cache")  # fmt: skip
        num_logits = num_logits or [1] * len(caches)
        with self._forward_lock:  # the slots are read under it: the adapter registry restacks under it
            slots = self._adapter_slots(adapters or [None] * len(token_ids))
            return self._forward_batch(token_ids, caches, num_logits, slots)

    def _adapter_slots(self, adapters: list[str | None]) -> list[int]:
        """Each row's LoRA adapter slot (-1: none). Families LoRA does not reach refuse any adapter."""
        refuse_adapters(self.config.architecture, adapters)
        return [-1] * len(adapters)

    def _forward_batch(self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int],
                       slots: list[int]) -> torch.Tensor:  # fmt: skip
        short = [row for row, ids in enumerate(token_ids) if len(ids) <= CHAIN_ROWS] if self._c_step() is not None else []
        if len(short) == len(token_ids):
            return self._steps_in_c(token_ids, caches, num_logits, slots)
        if not short:
            return self._scan_batch(token_ids, caches, num_logits, slots)
        # The short rows (decodes, verifies, short chunks) take the C step, so a row's bits do not
        # depend on what else the step holds; longer prompt chunks take the scan.
        others = sorted(set(range(len(token_ids))) - set(short))
        parts = {}
        for rows, run in ((short, self._steps_in_c), (others, self._scan_batch)):
            logits = run([token_ids[row] for row in rows], [caches[row] for row in rows], [num_logits[row] for row in rows],
                         [slots[row] for row in rows])  # fmt: skip
            parts |= dict(zip(rows, logits.split([num_logits[row] for row in rows])))
        return torch.cat([parts[row] for row in range(len(token_ids))])

    def _scan_batch(self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int], slots: list[int]) -> torch.Tensor:
        """Ragged rows through the torch blocks (the prefill scan) -> each row's last num_logits logits [sum, V]
        (slots: all -1 here, `_adapter_slots` refused any adapter)."""
        lengths = [len(ids) for ids in token_ids]
        longest = max(lengths)
        padded = torch.tensor([ids + [0] * (longest - len(ids)) for ids in token_ids])  # [B, S]
        capture = [capture_points(cache, n) for cache, n in zip(caches, lengths)]
        h = F.embedding(padded, self.embed_tokens)  # [B, S, H]
        per_layer = []
        for i, block in enumerate(self.layers):
            conv = torch.cat([c.conv_state(i) for c in caches])
            recurrent = torch.cat([c.recurrent_state(i) for c in caches])
            out, captured = block.mixer(block.norm(h), conv, recurrent, capture)
            h = h + out
            per_layer.append(captured)
        for row, (cache, n) in enumerate(zip(caches, lengths)):
            snapshots = {point + 1: [per_layer[i][row][k] for i in range(len(self.layers))] for k, point in enumerate(capture[row])}
            for i, (conv, recurrent) in enumerate(snapshots.pop(n)):
                cache.write(i, conv, recurrent)
            cache.commit(n, snapshots)
        rows = [r for r, k in enumerate(num_logits) for _ in range(k)]
        columns = [lengths[r] - k + j for r, k in enumerate(num_logits) for j in range(k)]
        return self.lm_head(self.norm(h[torch.tensor(rows), torch.tensor(columns)]))  # [sum, V]

    def _c_step(self) -> Any:
        """The one-call C decode step, built on first use where the projections are quantized
        (None: the torch step; always where `c_decode` is False, which compares the two)."""
        if not self.c_decode:
            return None
        if self._step is None and self._runs_in_c():
            self._step = self._build_step()
        return self._step

    def _runs_in_c(self) -> bool:
        return runs_in_c(self)

    def _build_step(self) -> Any:
        return StateStep(self)

    def _steps_in_c(self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int], slots: list[int]) -> torch.Tensor:
        """Each row's few tokens (at most CHAIN_ROWS: a decode, a speculative verify, a short chunk)
        through the C step in one call per block for all of them, every weight read once; a row's
        tokens run as a chain, each as a one-token step of it runs, so a verify's or a short turn's
        states and logits are plain decoding's bit for bit -> each row's last num_logits logits [sum, V]."""
        counts = [len(ids) for ids in token_ids]
        h = self._embed_rows([token for ids in token_ids for token in ids])  # [sum(counts), hidden]
        self._run_c_step(h, caches, counts, slots)
        if counts != num_logits:  # only the rows whose logits are asked for
            ends = torch.tensor(counts).cumsum(0).tolist()
            h = h[[end - n + j for end, n in zip(ends, num_logits) for j in range(n)]]
        return self._logits_of(h)

    def _embed_rows(self, tokens: list[int]) -> torch.Tensor:
        return self.embed_tokens[torch.tensor(tokens)].float().contiguous()

    def _logits_of(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def _run_c_step(self, h: torch.Tensor, caches: list[SSMStateCache], counts: list[int], slots: list[int]) -> None:
        """h [sum(counts), hidden] (updated in place) through every block, cache i's next counts[i]
        tokens; each cache's states committed (slots: all -1 here, `_adapter_slots` refused any adapter)."""
        layers = range(len(self.layers))
        convs, states = self._step(h, [[c.conv_state(i) for i in layers] for c in caches],
                                   [[c.recurrent_state(i) for i in layers] for c in caches], counts)  # fmt: skip
        first = 0
        for cache, count in zip(caches, counts):
            commit_chain(cache, [list(zip(convs[row], states[row])) for row in range(first, first + count)])
            first += count
