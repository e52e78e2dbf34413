"""Token-tree verification on the default 4-bit SmolLM2: each row of a tree (a chain of drafts and
alternatives beside it) gets the bits a plain one-token step gives its token after its own path,
over a contiguous cache and a paged one whose blocks the paths cross; an accepted alternative's key
and value move to where plain decoding would have written them; EAGLE drafting with alternatives
gives plain greedy decoding's tokens; draft_alternatives is refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch

from kvgen import SamplingParams, SpeculativeConfig
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec, KVCache
from kvgen.kv.paged import PagedCache, PagedStorage
from kvgen.sampling.grammar import StructuredOutput

from .test_eagle import chat_ids

# Row 0 follows the cache, rows 1-2 chain after it, rows 3 and 5 are alternatives to row 1, and
# row 4 follows row 3: paths of depth 1, 2 and 3 that share only the first row.
TOKENS = [11, 22, 33, 44, 55, 66]
PARENTS = [-1, 0, 1, 0, 3, 0]
PATHS = [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4], [0, 5]]


def new_cache(model, kind: str) -> KVCache:
    spec = CacheSpec.for_model(model.config, model.dtype)
    if kind == "contiguous":
        return ContiguousCache(spec, 64)
    return PagedCache(PagedStorage(spec, BlockPool(num_blocks=32, block_size=4)))  # paths cross block edges


def prefilled(model, kind: str, prompt: list[int]) -> KVCache:
    cache = new_cache(model, kind)
    model.hidden_states(torch.tensor([prompt]), cache)
    return cache


def stored(cache: KVCache, position: int) -> list[torch.Tensor]:
    """The key and value every layer and head holds at `position`: [layers, kv heads, head_dim] each."""
    layout, spec = cache.kernel_layout(cache.seq_len), cache.spec
    offset = int(layout.position_offsets(torch.tensor([position])))
    shape, strides = (spec.num_layers, spec.num_kv_heads, spec.head_dim), (layout.layer_stride, layout.head_stride, 1)
    return [store.as_strided(shape, strides, store.storage_offset() + offset) for store in (layout.keys, layout.values)]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@torch.inference_mode()
def test_each_tree_row_is_its_tokens_plain_step_after_its_path(smollm2_q4, kind: str):
    model = smollm2_q4.model
    prompt = smollm2_q4.tokenizer.encode("The lighthouse keeper climbed the stairs and")  # 9 tokens: not block-aligned
    tree = prefilled(model, kind, prompt)
    start = tree.seq_len
    h = model.tree_hidden_states(torch.tensor([TOKENS]), tree, PARENTS)
    assert h is not None and tree.seq_len == start + len(TOKENS)
    for row, path in enumerate(PATHS):
        plain = prefilled(model, kind, prompt)
        for r in path:
            want = model.hidden_states(torch.tensor([[TOKENS[r]]]), plain)[0, 0]
        assert torch.equal(h[0, row], want), (kind, row)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@torch.inference_mode()
def test_an_accepted_alternative_leaves_the_cache_plain_decoding_leaves(smollm2_q4, kind: str):
    """Rows 0, 3 and 4 accepted: their keys and values moved to the first three positions after
    the prompt equal those of decoding the three tokens one by one."""
    model = smollm2_q4.model
    prompt = smollm2_q4.tokenizer.encode("The lighthouse keeper climbed the stairs and")
    tree = prefilled(model, kind, prompt)
    start = tree.seq_len
    model.tree_hidden_states(torch.tensor([TOKENS]), tree, PARENTS)
    layout = tree.kernel_layout(tree.seq_len)
    layout.copy_position(start + 3, start + 1, tree.spec)
    layout.copy_position(start + 4, start + 2, tree.spec)
    tree.truncate(start + 3)
    plain = prefilled(model, kind, prompt)
    for r in PATHS[4]:
        model.hidden_states(torch.tensor([[TOKENS[r]]]), plain)
    assert tree.seq_len == plain.seq_len
    for position in range(tree.seq_len):
        for ours, theirs in zip(stored(tree, position), stored(plain, position)):
            assert torch.equal(ours, theirs), (kind, position)


def test_eagle_with_alternatives_equals_plain_greedy_and_takes_alternatives(smollm2_q4):
    prompt = chat_ids(smollm2_q4)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = smollm2_q4.generate(prompt, params)
    for alternatives in (1, 3):
        config = SpeculativeConfig("eagle", num_draft_tokens=2, adaptive=False, draft_alternatives=alternatives)
        result = smollm2_q4.generate(prompt, params, speculative=config)
        assert result.token_ids == plain.token_ids, alternatives
        stats = result.speculative
        assert stats.verify_steps > 10 and stats.alternative_tokens > 0, stats  # the target took alternatives


def test_draft_alternatives_are_refused_where_they_cannot_apply(smollm2_q4, smollm2):
    with pytest.raises(ValueError, match="draft_alternatives is only used by method 'eagle'"):
        SpeculativeConfig("lookup", draft_alternatives=1)
    with pytest.raises(ValueError, match=r"draft_alternatives must be in \[0, 3\]"):
        SpeculativeConfig("eagle", draft_alternatives=4)
    asked = SpeculativeConfig("eagle", draft_alternatives=2)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=4)
    structured = SamplingParams(max_new_tokens=4, structured=StructuredOutput.regex("[0-9]+"))
    for params in (sampled, structured):
        with pytest.raises(ValueError, match="draft_alternatives are verified for greedy requests"):
            smollm2_q4.generate("Count:", params, speculative=asked)
    # Refused before any work: a session keeps its cache and its next turn runs.
    session = smollm2_q4.session()
    first = session.stream("Count to three:", SamplingParams(max_new_tokens=4))
    list(first)
    cached, length = list(session.cached_ids), session.cache.seq_len
    more = first.prompt_ids + first.result.token_ids + smollm2_q4.tokenizer.encode(" and on:")
    with pytest.raises(ValueError, match="draft_alternatives are verified for greedy requests"):
        session.stream(more, sampled, speculative=asked)
    assert session.cached_ids == cached and session.cache.seq_len == length
    after = session.stream(more, SamplingParams(max_new_tokens=4), speculative=SpeculativeConfig("eagle"))
    list(after)
    assert after.result.usage.cached_tokens == length and len(after.result.token_ids) == 4
    # Over fp32 weights the target runs no C rows step, so it verifies no trees: asked for, refused.
    with pytest.raises(ValueError, match="draft_alternatives are verified as a token tree by the C rows step"):
        smollm2.generate("Count:", SamplingParams(max_new_tokens=4), speculative=asked)
    # Left unset, a sampled request drafts chains.
    assert smollm2_q4.generate("Count:", sampled, speculative=SpeculativeConfig("eagle")).token_ids
