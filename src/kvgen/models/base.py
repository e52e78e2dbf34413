"""DecoderLM: embeddings -> blocks -> norm -> logits, shared by every family.

A family supplies its block class (and options such as the embedding scale); everything about
positions, masks and the cache lives here once.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig, RopeScaling
from kvgen.kv.interface import AttentionSpan, KVCache
from kvgen.models.batch import BatchCacheView, build_batch_mask
from kvgen.models.embedding import QuantizedEmbedding, QuantizedRows
from kvgen.models.layers import AttentionMask, RMSNorm
from kvgen.models.lora import LoraStacks, adapter_slots
from kvgen.models.half_linear import C_STEP_LINEARS
from kvgen.models.rotary import LongRopeEmbedding, RotaryEmbedding, apply_rotary, inverse_frequencies
from kvgen.models.weights import WeightSource, linear, token_embedding

RopeKey = tuple[float, RopeScaling | None]
NO_ROPE: RopeKey = (0.0, None)  # the key of layers without RoPE (no real base is 0)


class DecoderLM(nn.Module):
    # Gemma stores norm weights as w and multiplies by (1 + w); Llama multiplies by w.
    norm_offset: float = 0.0
    embed_scale: float | None = None

    def __init__(self, config: ModelConfig, weights: WeightSource):
        super().__init__()
        self.config = config
        self._forward_lock = threading.Lock()
        if config.embedding_multiplier != 1.0:  # Granite's (Gemma sets its own sqrt(hidden))
            self.embed_scale = config.embedding_multiplier
        # [V, H]: a float table, or a quantized file's rows (models/embedding.py), looked up as read
        table = weights.take("model.embed_tokens.weight")
        self.layers = nn.ModuleList([self.build_block(config, i, weights) for i in range(config.num_layers)])
        self.norm = RMSNorm(weights.take_tensor("model.norm.weight") + self.norm_offset, config.rms_norm_eps)
        # A quantized tied model gets its own quantized copy of the embedding as "lm_head.weight".
        head = weights.take("lm_head.weight") if weights.has("lm_head.weight") else table
        assert not isinstance(head, QuantizedRows), "a quantized file's embedding comes with its head"
        self.lm_head = linear(head)  # [V, H]
        self.embed_tokens = token_embedding(table, self.lm_head, config.tie_word_embeddings)
        divisors = weights.take_tensor("rope_freqs") if weights.has("rope_freqs") else None  # Llama 3.1 GGUFs store their rope scaling as divisors
        # One RotaryEmbedding per distinct (theta, scaling); each layer knows which one it uses.
        layer_keys = [self.rope_key(i) for i in range(config.num_layers)]
        distinct = list(dict.fromkeys(layer_keys))
        self.ropes = nn.ModuleList()
        for theta, scaling in distinct:
            self.ropes.append(self.build_rope(theta, scaling, divisors if theta == config.rope_theta else None))
        self.rope_index = [distinct.index(key) for key in layer_keys]  # per layer: which of self.ropes

    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        raise NotImplementedError

    def build_rope(self, theta: float, scaling: RopeScaling | None, divisors: torch.Tensor | None) -> RotaryEmbedding:
        rotary_dim = self.config.rotary_dim or self.config.head_dim  # partial rotary turns fewer channels
        if theta == NO_ROPE[0]:  # a NoPE layer turns every channel by angle 0: cos 1, sin 0, exactly the identity
            return RotaryEmbedding(torch.zeros(rotary_dim // 2))
        if scaling is not None and scaling.kind == "longrope":
            return LongRopeEmbedding(rotary_dim, theta, scaling)
        inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
        attention_factor = scaling.attention_factor if scaling is not None else 1.0  # YaRN's; 1 for the others
        return RotaryEmbedding(inv_freq / divisors if divisors is not None else inv_freq, attention_factor)

    def rerotate(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys [B, H, S, D] rotated by RoPE at position p -> as if at p + delta (exact: RoPE angles
        add). The bare rotation: a cached key already carries YaRN's attention factor."""
        cos, sin = self.rope_for(layer).turns(torch.tensor([[delta]], device=keys.device))  # [1, 1, D]
        return apply_rotary(keys.float(), cos[:, None], sin[:, None]).to(keys.dtype)

    def rope_key(self, layer: int) -> RopeKey:
        if layer in self.config.nope_layers:
            return NO_ROPE
        return self.config.rope_theta, self.config.rope_scaling

    def rope_for(self, layer: int) -> RotaryEmbedding:
        return self.ropes[self.rope_index[layer]]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if isinstance(self.embed_tokens, QuantizedEmbedding) else F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # scale in the weights' dtype, as HF does
        return h

    def _logits(self, h: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """row_invariant: a quantized head runs its C kernel whatever the row count (decode rows get
        the logits they would get alone)."""
        h = self.norm(h)
        logits = self.lm_head(h, row_invariant=True) if row_invariant and isinstance(self.lm_head, C_STEP_LINEARS) else self.lm_head(h)
        if self.config.logits_scaling != 1.0:  # Granite divides its logits
            logits = logits / self.config.logits_scaling
        if self.config.final_logit_softcapping:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embedding_table(self) -> torch.Tensor:
        """The token embedding as a float tensor [V, H] (a quantized one dequantized whole)."""
        table = self.embed_tokens
        return table.dequantized() if isinstance(table, QuantizedEmbedding) else table.data

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live: the CPU, or a GPU the model was moved to (models/device.py)."""
        return self.embed_tokens.device

    # The loaded LoRA adapters' weights (kvgen/lora/registry.py attaches them to the blocks).
    lora: LoraStacks | None = None

    def _activate_adapters(self, adapters: Sequence[str | None] | None, row_tokens: Sequence[int]) -> bool:
        """Rows of the next forward use these adapters (by name; None: the base model). True when
        some row has one: the torch path then adds each row's delta (the C steps take slots instead)."""
        if adapters is None or all(a is None for a in adapters):
            return False
        slots = adapter_slots(self.lora, adapters)  # ValueError for one not loaded
        assert self.lora is not None
        return self.lora.activate_slots(slots, row_tokens)

    # One-token decode steps run in C when the weights are quantized (models/fast_decode.py);
    # set False to force the torch path (the reference the C path is tested against).
    use_fast_decode: bool = True
    _fast_decoder: object | None = None

    def fast_decoder(self):  # -> FastDecoder | None, built on first use
        from kvgen.models.fast_decode import FastDecoder

        if self._fast_decoder is None and FastDecoder.supports(self):
            self._fast_decoder = FastDecoder(self)
        return self._fast_decoder

    # A GPU model's one-token steps replay CUDA graphs (models/cuda_graphs.py); set False to launch
    # every kernel from Python instead (the eager path the graphs are measured against).
    use_cuda_graphs: bool = True
    compile_cuda_graphs: bool = False  # the graphs' step through torch.compile first (LLM.load's torch_compile)
    _cuda_graphs: object | None = None

    def cuda_graphs(self):  # -> CudaGraphDecoder, built on first use by a model on a GPU
        from kvgen.models.cuda_graphs import CudaGraphDecoder

        if self._cuda_graphs is None:
            self._cuda_graphs = CudaGraphDecoder(self, compiled=self.compile_cuda_graphs)
        return self._cuda_graphs

    def greedy_steps(self, token: int, cache: KVCache, steps: int) -> list[int] | None:
        """A GPU model's next `steps` greedy tokens after `token`, decoded by CUDA graph replays
        without a host round trip between them (the cache then holds `token` and all of them but
        the last); None where the graphs cannot run them."""
        if not self.use_cuda_graphs or self.device.type != "cuda":
            return None
        with self._forward_lock:
            return self.cuda_graphs().greedy(token, cache, steps)

    def _c_step(self, cache: KVCache):  # -> FastDecoder | None
        """The C decode step for one sequence over `cache`, or None where the torch path must run
        (no C path for these weights; a biased cache: the C step knows no bias)."""
        decoder = self.fast_decoder() if self.use_fast_decode else None
        return None if decoder is None or cache.key_bias() is not None else decoder

    def _fast_hidden(
        self, input_ids: torch.Tensor, cache: KVCache, slot: int = -1, num_layers: int | None = None,
        prompt: bool = False,
    ) -> torch.Tensor | None:  # fmt: skip
        """input_ids [1, S] -> the last block's output [1, S, H] through the C step: one token by
        the decode step, several (a speculative verify, or a prompt when `prompt` and the decoder
        runs prompts) as kernel rows of the rows step, at most `max_rows` per call, so each token
        gets what plain decoding would give it, however the tokens are split; slot: the LoRA
        adapter slot (-1: none). None when the torch path must run (no C path, a biased cache, no
        fp32 layout for several tokens, a prompt with KVGEN_PREFILL_GEMM=fp32|bf16)."""
        decoder = self._c_step(cache)
        seq = input_ids.shape[1]
        if decoder is None or (prompt and seq > 1 and not decoder.runs_prompts):
            return None
        start = cache.seq_len
        h = self._embed(input_ids[0]).contiguous()  # [S, H], updated in place by the C blocks
        if seq == 1:
            if not decoder.step(h[0], decoder.rope_at(start), cache, slot, num_layers):
                return None
            return h[None]
        positions = torch.arange(start, start + seq)
        rope = decoder.rope_rows(start, seq)  # [S, kinds, 2, D]
        try:
            for first in range(0, seq, decoder.max_rows):  # each call commits its rows
                rows = slice(first, first + decoder.max_rows)
                if not self._rows_of_one(decoder, h[rows], rope[rows], cache, positions[rows], slot, num_layers):
                    assert first == 0, "a cache offered the rows step, then did not"
                    return None
        except BaseException:
            cache.truncate(start)  # all or nothing, as the torch forward commits
            raise
        return h[None]

    @staticmethod
    def _rows_of_one(decoder, h: torch.Tensor, rope: torch.Tensor, cache: KVCache, positions: torch.Tensor,
                     slot: int, num_layers: int | None = None) -> bool:  # fmt: skip
        """Tokens of one sequence as kernel rows of the rows step, over the cache's fp32 layout or,
        where it has none (a pool split into layer groups), its batch view of one row, as the
        engine's batches run it; commits them. False (nothing done) when the cache offers neither.
        num_layers: the first blocks only (a layer-skip draft's catch-up), over an fp32 layout only."""
        if decoder.step_tokens(h, rope, cache, positions, slot, num_layers):
            return True
        if cache.batch_path_only or num_layers not in (None, len(decoder.blocks)):
            return False  # a pool of codes: forward_batch runs it (one-token rows only)
        rows = h.shape[0]
        view = type(cache).batch_view([cache], [rows])
        kernel = view.rows_kernel() if view is not None else None  # type: ignore[attr-defined]
        if kernel is None:
            return False
        decoder.step_rows(h, rope, kernel, positions, [slot] * rows)
        cache.commit(rows)
        return True

    def _rows_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cos/sin of each kernel row's position for every RoPE kind: [rows, kinds, 2, head_dim]
        (partial rotary: the turned channels' angles first, zeros after)."""
        table = torch.stack(
            [torch.stack([t[:, 0, 0] for t in rope(positions[:, None], dtype)], dim=1) for rope in self.ropes], dim=1
        )
        narrower = self.config.head_dim - table.shape[-1]
        return (F.pad(table, (0, narrower)) if narrower else table).contiguous()

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        logits_to_keep: int | None = 1,
        adapter: str | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] at positions cache.seq_len.. -> logits [B, logits_to_keep or S, V].

        Appends the S positions to `cache` (committed only after every layer succeeded). One forward
        at a time per model: the C decode path and the quantized layers reuse scratch buffers.
        `adapter`: the loaded LoRA adapter every row runs with (None: the base model).
        """
        input_ids = input_ids.to(self.device)
        with self._forward_lock:
            batch, seq = input_ids.shape
            with_lora = adapter is not None and self._activate_adapters([adapter] * batch, [seq] * batch)
            try:
                slot = self.lora.slots[adapter] if with_lora else -1  # type: ignore[union-attr]
                return self._forward(input_ids, cache, positions, logits_to_keep, with_lora, slot)
            finally:
                if with_lora:
                    self.lora.deactivate()  # type: ignore[union-attr]

    def _forward(
        self, input_ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None, logits_to_keep: int | None,
        with_lora: bool = False, slot: int = -1,
    ) -> torch.Tensor:  # fmt: skip
        batch, seq = input_ids.shape
        on_gpu = self.use_cuda_graphs and self.device.type == "cuda"
        if on_gpu and batch == 1 and seq == 1 and positions is None and not with_lora:
            logits = self.cuda_graphs().step(input_ids, cache)
            if logits is not None:
                return logits  # [1, 1, V]
        # One sequence takes the C step (with the LoRA slot's deltas, if any): a decode, a verify
        # and, where the decoder runs prompts, a prompt (logits of its last tokens only).
        if batch == 1 and positions is None:
            prompt = seq > 1 and logits_to_keep not in (None, seq)
            fast = self._fast_hidden(input_ids, cache, slot, prompt=prompt)
            if fast is not None:
                return self._logits(fast[:, -logits_to_keep:] if logits_to_keep else fast, row_invariant=True)
        h = self._hidden_states(input_ids, cache, positions, self.config.num_layers)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self._logits(h)  # [B, S', V]

    def hidden_states(self, input_ids: torch.Tensor, cache: KVCache, num_layers: int | None = None) -> torch.Tensor:
        """input_ids [B, S] -> the last block's output [B, S, H] (before the final norm), after the
        first `num_layers` blocks only if given (a layer-skip draft; `cache` then needs only those
        layers). `logits_from_hidden` turns them into logits. All layers of one sequence take the C
        step where `forward` would (a decode or a verify); a layer-skip draft's steps and catch-ups
        take it too, over the first layers (where its cache has an fp32 layout; else the torch path)."""
        num_layers = self.config.num_layers if num_layers is None else num_layers
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        with self._forward_lock:
            if input_ids.shape[0] == 1:
                fast = self._fast_hidden(input_ids, cache, num_layers=num_layers)
                if fast is not None:
                    return fast
            return self._hidden_states(input_ids, cache, None, num_layers)

    def verifies_trees(self, cache: KVCache) -> bool:
        """Whether `tree_hidden_states` runs over `cache`: the C step, over an fp32 layout."""
        return self._c_step(cache) is not None and cache.kernel_layout(cache.seq_len) is not None

    def tree_hidden_states(self, input_ids: torch.Tensor, cache: KVCache, parents: list[int]) -> torch.Tensor | None:
        """input_ids [1, S]: a token tree after the cache (row i's parent is row parents[i], -1: the
        cache's last position; see FastDecoder.step_tree) -> the last block's output [1, S, H], each
        row what `hidden_states` gives that token after its ancestors alone; row i's key and value
        sit in cache slot seq_len + i (S slots committed). None (nothing done) where the C rows step
        over an fp32 layout is not at hand: a tree is then verified as a chain."""
        decoder = self._c_step(cache)
        if decoder is None or input_ids.shape[0] != 1:
            return None
        with self._forward_lock:
            h = self._embed(input_ids[0].to(self.device)).contiguous()  # [S, H], updated in place
            return h[None] if decoder.step_tree(h, cache, parents) else None

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] block output -> [..., V] logits (final norm, head, softcapping); a quantized
        head runs its C kernel, as the decode step's logits do."""
        return self._logits(h, row_invariant=True)

    def _hidden_states(
        self, input_ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None, num_layers: int
    ) -> torch.Tensor:
        batch, seq = input_ids.shape
        start = cache.seq_len
        if positions is None:
            positions = torch.arange(start, start + seq, device=input_ids.device).expand(batch, seq)
        h = self._embed(input_ids)  # [B, S, H]
        ropes = [rope(positions, h.dtype) for rope in self.ropes]
        key_bias = cache.key_bias()
        masks: dict[tuple[AttentionSpan, int], AttentionMask] = {}
        for i, block in enumerate(self.layers[:num_layers]):
            span, key_start = cache.attention_span(i, self.config.window_for(i)), cache.visible_start(i)
            if (span, key_start) not in masks:
                num_keys = start + seq - key_start
                masks[span, key_start] = AttentionMask.build(
                    start, seq, key_start, num_keys, span.window, span.sinks, span.chunk, key_bias=key_bias
                ).to(h.device)
            h = block(h, ropes[self.rope_index[i]], cache, masks[span, key_start])
        cache.commit(seq)
        return h  # [B, S, H]

    def forward_batch(
        self, token_ids: list[list[int]], caches: list[KVCache], num_logits: Sequence[int] | None = None,
        adapters: Sequence[str | None] | None = None, with_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Ragged batch: row i appends token_ids[i] (>= 1 tokens) at caches[i].seq_len.. to its own
        cache -> logits of each row's last token, [B, V]; with `num_logits`, of row i's last
        num_logits[i] tokens (a speculative row verifies its drafts), rows one after another [sum, V].
        with_hidden: (logits, the last block's output at the same tokens [sum, H]), the features
        `hidden_states` gives and an EAGLE head drafts from.

        One forward with a batch dimension (rows padded to the longest); every cache is committed
        only after all layers succeeded, so a failure leaves every cache's length as it was.
        `adapters`: per row the loaded LoRA adapter it runs with (None: the base model).
        """
        if len(token_ids) != len(caches) or not caches:
            raise ValueError(f"forward_batch needs one cache per row and at least one row, got {len(token_ids)} rows and {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("forward_batch got the same cache for two rows: each row needs its own cache")
        if any(len(ids) == 0 for ids in token_ids):
            raise ValueError("every row of forward_batch needs at least one token")
        num_logits = list(num_logits) if num_logits is not None else [1] * len(token_ids)
        if len(num_logits) != len(token_ids) or any(not 1 <= n <= len(ids) for n, ids in zip(num_logits, token_ids)):
            raise ValueError(f"num_logits needs one count per row, each between 1 and the row's length, got {num_logits}")
        if adapters is not None and len(adapters) != len(token_ids):
            raise ValueError(f"adapters needs one entry per row (None for the base model), got {len(adapters)} for {len(token_ids)} rows")
        # One row alone takes the single-sequence path and its C kernels. Not under an adapter: its
        # decodes then run the batch path's attention, the one they meet beside other rows, so
        # that a row gets the same bits alone or batched (int8 activations amplify any difference).
        with_adapter = adapters is not None and any(a is not None for a in adapters)
        if len(caches) == 1 and not caches[0].batch_path_only and not with_adapter:  # a verify too: see _fast_hidden
            if not with_hidden:
                return self.forward(torch.tensor(token_ids), caches[0], logits_to_keep=num_logits[0])[0]
            h = self.hidden_states(torch.tensor(token_ids), caches[0])[0, -num_logits[0] :]
            with self._forward_lock:
                return self.logits_from_hidden(h), h
        with self._forward_lock:
            longest = max(len(ids) for ids in token_ids)
            with_lora = self._activate_adapters(adapters, [longest] * len(token_ids))
            slots = self.lora.slots_of(adapters) if with_lora else None  # type: ignore[union-attr, arg-type]
            try:
                h, row_invariant = self._forward_batch(token_ids, caches, num_logits, with_lora, slots)
                logits = self._logits(h[None], row_invariant=row_invariant)[0]  # [sum(num_logits), V]
            finally:
                if with_lora:
                    self.lora.deactivate()  # type: ignore[union-attr]
        return (logits, h) if with_hidden else logits

    def _rows_fast(
        self, token_ids: list[list[int]], caches: list[KVCache], num_logits: list[int], slots: list[int] | None = None
    ) -> torch.Tensor | None:  # fmt: skip
        """Rows whose caches offer the C step over every layer (a paged store of fp32 blocks, or of
        codes for one-token rows) and quantized weights: FastDecoder.step_rows -> the last block's
        output at the rows' last num_logits tokens [sum(num_logits), H]; None when the torch path
        must run. Every token is a kernel row computed as a lone decode would compute it, so a
        decode's logits do not depend on the batch,
        a speculative verify gives each position the logits plain decoding would, and a prompt
        chunk's rows (where the decoder runs prompts) get the bits of the prompt prefilled whole or
        in any other chunks. Rows run in steps of at most `max_rows` tokens (a longer row takes the
        torch path). slots: each row's LoRA adapter slot (-1: none), its deltas added in the C step."""
        decoder = self.fast_decoder() if self.use_fast_decode else None
        lengths = [len(ids) for ids in token_ids]
        prompt = num_logits != lengths  # prompt chunks want the logits of their last token only
        if decoder is None or max(lengths) > decoder.max_rows or (prompt and not decoder.runs_prompts):
            return None
        steps: list[list[int]] = [[]]  # row indices per C step
        filled = 0  # tokens in the last step
        for i, n in enumerate(lengths):
            if filled + n > decoder.max_rows:
                steps.append([])
                filled = 0
            steps[-1].append(i)
            filled += n
        kernels = []
        for step in steps:  # every step's kernel before any runs: all or nothing
            view = type(caches[0]).batch_view([caches[i] for i in step], [lengths[i] for i in step])  # reserves slots
            kernel = view.rows_kernel() if view is not None else None  # type: ignore[attr-defined]
            if kernel is None:
                return None
            kernels.append((view, kernel))
        hidden = []
        for step, (_view, kernel) in zip(steps, kernels):
            positions = torch.cat([torch.arange(caches[i].seq_len, caches[i].seq_len + lengths[i]) for i in step])
            h = self._embed(torch.tensor([t for i in step for t in token_ids[i]])).contiguous()  # [rows, H]
            rope = self._rows_rope(positions, h.dtype)
            row_slots = [slots[i] for i in step for _ in range(lengths[i])] if slots is not None else None
            decoder.step_rows(h, rope, kernel, positions, row_slots)
            for i in step:
                caches[i].commit(lengths[i])
            ends = torch.tensor([lengths[i] for i in step]).cumsum(0).tolist()
            hidden.append(h[[end - num_logits[i] + j for end, i in zip(ends, step) for j in range(num_logits[i])]])
        return torch.cat(hidden)

    def _forward_batch(
        self, token_ids: list[list[int]], caches: list[KVCache], num_logits: list[int], with_lora: bool = False,
        slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, bool]:  # fmt: skip
        """-> the last block's output at the rows' last num_logits tokens [sum(num_logits), H], and
        whether the C rows step computed it (its logits then run the head's C kernel too)."""
        fast = self._rows_fast(token_ids, caches, num_logits, slots)
        if fast is not None:
            return fast, True
        lengths, starts = [len(ids) for ids in token_ids], [c.seq_len for c in caches]
        longest = max(lengths)
        padded = torch.tensor([ids + [0] * (longest - len(ids)) for ids in token_ids])  # [B, S]
        positions = torch.tensor(starts)[:, None] + torch.arange(longest)[None, :]  # [B, S]
        h = self._embed(padded)  # [B, S, H]
        ropes = [rope(positions, h.dtype) for rope in self.ropes]
        view = type(caches[0]).batch_view(caches, lengths) or BatchCacheView(caches, lengths)
        masks: dict[tuple[tuple[AttentionSpan, ...], tuple[int, ...]], AttentionMask] = {}
        key_biases = [c.key_bias() for c in caches]
        for i, block in enumerate(self.layers):
            window = self.config.window_for(i)
            spans = tuple(c.attention_span(i, window) for c in caches)
            key_starts = tuple(c.visible_start(i) for c in caches)
            if (spans, key_starts) not in masks:
                # The in-place kernels know no soft-capping (Gemma 2) or sinks (gpt-oss): those run the torch path.
                explicit = self.config.attn_logit_softcapping is not None or self.config.attention_sinks
                in_place = None if explicit else view.in_place_starts(lengths, spans)  # type: ignore[attr-defined]
                if in_place is not None:
                    masks[spans, key_starts] = AttentionMask(None, False, in_place)
                else:
                    allowed = build_batch_mask(starts, lengths, list(key_starts), list(spans))
                    if any(bias is not None for bias in key_biases):  # pooled slots (compressed caches)
                        allowed = AttentionMask.with_key_bias(allowed, key_biases)
                    masks[spans, key_starts] = AttentionMask(allowed, False)
            h = block(h, ropes[self.rope_index[i]], view, masks[spans, key_starts])
        for cache, n in zip(caches, lengths):
            cache.commit(n)
        rows = [i for i, n in enumerate(num_logits) for _ in range(n)]
        columns = [lengths[i] - n + j for i, n in enumerate(num_logits) for j in range(n)]
        return h[torch.tensor(rows), torch.tensor(columns)], False  # [sum(num_logits), H]
