"""The shipped EAGLE head on the 4-bit SmolLM2 it was trained for: the proposer, fed the features
the decoder hands it, drafts the target's own next token on a chat reply the head never saw in
training; its draft vocabulary's logits are the target head's rows; bad weight files are refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kvgen import SamplingParams, SpeculativeConfig
from kvgen.kernels.formats import requantize
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec
from kvgen.models.quantized_linear import QuantizedLinear
from kvgen.speculative.eagle import SHIPPED_WEIGHTS, EagleProposer, load_eagle_head, save_eagle_head
from kvgen.speculative.proposer import DraftPolicy

# Not among the training requests (scripts/eagle_prompts.py): the benchmark's chat request.
CHAT = "Write a short story about an old lighthouse keeper and the night the light almost failed."


def chat_ids(llm) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def test_the_proposer_drafts_the_targets_next_token_on_a_chat_reply(smollm2_q4):
    """At every reply position t the decoder gives the proposer the target's feature at t and the
    committed ids up to t+1; the draft must be the target's greedy token at t+2. Fed the wrong
    position's feature, the wrong layer or the plain-text head, agreement drops to ~0.1."""
    llm, model = smollm2_q4, smollm2_q4.model
    prompt = chat_ids(llm)
    reply = llm.generate(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True)).token_ids
    ids = prompt + reply
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(ids))
    features = model.hidden_states(torch.tensor([ids]), cache)[0]  # the rows step, as verify runs it
    proposer = SpeculativeConfig("eagle").build_proposer(llm.generator)
    policy = DraftPolicy(SamplingParams())
    hits = []
    for t in range(len(prompt), len(ids) - 2):  # the decoder hands over features from the reply's first token
        proposer.observe_features(features[t : t + 1])
        hits.append(proposer.propose(ids[: t + 2], 1, policy, None).tokens == [ids[t + 2]])
    assert sum(hits) / len(hits) >= 0.35, sum(hits) / len(hits)


@torch.inference_mode()
def test_features_handed_over_in_verify_sized_runs_draft_as_one_at_a_time(smollm2_q4):
    """A verify hands the proposer several committed rows at once, a probe or plain step one: the
    head's cache must come out the same either way, so chains drafted after each agree."""
    llm, model = smollm2_q4, smollm2_q4.model
    prompt = chat_ids(llm)
    ids = prompt + llm.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(ids))
    features = model.hidden_states(torch.tensor([ids]), cache)[0]
    config, policy = SpeculativeConfig("eagle"), DraftPolicy(SamplingParams())
    single, grouped = config.build_proposer(llm.generator), config.build_proposer(llm.generator)
    first, drafts = len(prompt), 0
    for run in (1, 3, 2, 4, 1, 5, 3):  # rows committed by successive target forwards
        end = first + run
        for t in range(first, end):
            single.observe_features(features[t : t + 1])
            if t < end - 1:  # one-at-a-time drafts in between (discarded by the next observation)
                single.propose(ids[: t + 2], 2, policy, None)
        grouped.observe_features(features[first:end])
        one = single.propose(ids[: end + 1], 3, policy, None).tokens
        assert grouped.propose(ids[: end + 1], 3, policy, None).tokens == one
        drafts += len(one)
        first = end
    assert drafts == 21


def test_eagle_on_chat_accepts_drafts_and_equals_plain_greedy(smollm2_q4):
    prompt = chat_ids(smollm2_q4)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = smollm2_q4.generate(prompt, params)
    # A fixed length: every step drafts (the adaptive controller would pause a head accepting ~0.3).
    fixed = SpeculativeConfig("eagle", num_draft_tokens=2, min_draft_tokens=2, max_draft_tokens=2, adaptive=False)
    result = smollm2_q4.generate(prompt, params, speculative=fixed)
    assert result.token_ids == plain.token_ids
    assert result.speculative.verify_steps > 20 and result.speculative.accepted_tokens > 5


@torch.inference_mode()
def test_draft_vocabulary_logits_are_the_target_heads_rows(smollm2_q4):
    model = smollm2_q4.model
    proposer = EagleProposer(model, load_eagle_head(None, model))
    h = torch.randn(1, model.config.hidden_size) * 10
    full = model.logits_from_hidden(h)[0]
    torch.testing.assert_close(proposer.draft_logits(h), full[proposer.vocab], atol=2e-3, rtol=1e-4)


def test_bad_head_files_are_refused(smollm2_q4, tmp_path: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = smollm2_q4.model
    tensors = load_file(str(SHIPPED_WEIGHTS))
    with safe_open(str(SHIPPED_WEIGHTS), "pt") as f:
        meta = f.metadata()
    no_vocab = {k: v for k, v in tensors.items() if k != "draft_vocab"}
    save_file(no_vocab, str(tmp_path / "a.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        load_eagle_head(tmp_path / "a.safetensors", model)
    no_layer = {k: v for k, v in tensors.items() if k != "fc.weight"}  # e.g. an older MLP head's file
    save_file(no_layer, str(tmp_path / "c.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="not a one-layer head"):
        load_eagle_head(tmp_path / "c.safetensors", model)
    save_file(tensors, str(tmp_path / "e.safetensors"), metadata={k: v for k, v in meta.items() if k != "kv_heads"})
    with pytest.raises(ValueError, match="does not record its kv_heads"):
        load_eagle_head(tmp_path / "e.safetensors", model)
    save_file(tensors, str(tmp_path / "d.safetensors"), metadata=meta | {"hidden_size": "960"})
    with pytest.raises(ValueError, match="hidden size 960"):
        load_eagle_head(tmp_path / "d.safetensors", model)
    head = load_eagle_head(None, model)
    head.draft_vocab[0] = model.config.vocab_size
    save_eagle_head(head, tmp_path / "b.safetensors", "smollm2")
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        load_eagle_head(tmp_path / "b.safetensors", model)


@torch.inference_mode()
def test_training_chains_are_what_the_head_cache_drafts():
    """The training-time test (EagleHead.forward_chains) must run each chain as the proposer does:
    the target-fed positions up to j in the head's cache, then the head on its own predictions."""
    from kvgen.speculative.eagle_head import EagleHead, HeadCache

    torch.manual_seed(0)
    head = EagleHead(64, 4, 2, 16, 96, torch.arange(10)).eval()
    for p in head.parameters():  # untrained norms are all ones: make every weight matter
        p.add_(torch.randn_like(p) * 0.2)
    seq, depth = 12, 3
    features, tokens = torch.randn(2, seq, 64), torch.randn(2, seq + depth - 1, 64)
    chains = head.forward_chains(features, tokens, depth)
    torch.testing.assert_close(chains[0], head.forward_sequences(features, tokens[:, :seq]))
    for b in range(2):
        for j in (0, 5, seq - 1):
            cache = HeadCache(head, capacity=4)  # grown on the way
            drafted = cache.run(features[b, : j + 1], tokens[b, : j + 1])[-1:]
            torch.testing.assert_close(chains[0][b, j], drafted[0], atol=1e-4, rtol=1e-4)
            for step in range(1, depth):
                drafted = cache.run(drafted, tokens[b, j + step][None])
                torch.testing.assert_close(chains[step][b, j], drafted[0], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_the_c_head_step_computes_the_heads_layer():
    """On a quantized target the head's layer runs the C decode step over its 8-bit linears; it must
    compute what the torch layer computes with the same 8-bit linears (the same kernel, int8
    activations included), a position at a time or several at once, after a truncation too."""
    from kvgen.speculative.eagle_fast import FastHeadCache, FastHeadWeights
    from kvgen.speculative.eagle_head import EagleHead, HeadCache

    torch.manual_seed(0)
    head = EagleHead(128, 4, 2, 32, 256, torch.arange(10)).eval()
    for p in head.parameters():
        p.add_(torch.randn_like(p) * 0.2)
    quantized = copy.copy(head)  # the torch layer, each linear the 8-bit C kernel
    quantized._modules = dict(head._modules) | {
        name: QuantizedLinear(requantize(linear.weight, "q8s"))
        for name, linear in head.named_children() if isinstance(linear, torch.nn.Linear)
    }  # fmt: skip
    features, tokens = torch.randn(20, 128), torch.randn(20, 128)
    fast, reference = FastHeadCache(FastHeadWeights(head), capacity=8), HeadCache(quantized, capacity=8)  # both grow
    for first, end in ((0, 1), (1, 4), (4, 5), (5, 12), (12, 20), (5, 7)):
        fast.truncate(first), reference.truncate(first)
        got, want = fast.run(features[first:end], tokens[first:end]), reference.run(features[first:end], tokens[first:end])
        assert fast.length == reference.length == end
        layer = want - features[first:end]  # the layer's own output
        assert (got - want).norm() < 1e-5 * layer.norm(), first


@torch.inference_mode()
def test_the_c_head_step_gives_a_position_the_same_bits_alone_or_among_others():
    """Positions run together (kvgen_eagle_positions: the tokens decoded while drafting paused, a
    verify's accepted ones) get the bits each gets run alone (kvgen_eagle_position), their keys and
    values too, so the drafts do not depend on how the decoder hands the features over."""
    from kvgen.speculative.eagle_fast import FastHeadCache, FastHeadWeights
    from kvgen.speculative.eagle_head import EagleHead

    torch.manual_seed(1)
    head = EagleHead(128, 4, 2, 32, 256, torch.arange(10)).eval()
    for p in head.parameters():
        p.add_(torch.randn_like(p) * 0.2)
    weights = FastHeadWeights(head)
    features, tokens = torch.randn(40, 128), torch.randn(40, 128)
    alone, together = FastHeadCache(weights, capacity=8), FastHeadCache(weights, capacity=8)  # both grow
    one_at_a_time = torch.cat([alone.run(features[i : i + 1], tokens[i : i + 1]) for i in range(40)])
    runs = torch.cat([together.run(features[a:b], tokens[a:b]) for a, b in ((0, 3), (3, 4), (4, 20), (20, 40))])
    assert torch.equal(runs, one_at_a_time), (runs - one_at_a_time).abs().max().item()
    assert torch.equal(together.k[:, :40], alone.k[:, :40]) and torch.equal(together.v[:, :40], alone.v[:, :40])
