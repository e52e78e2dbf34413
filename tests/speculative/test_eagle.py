"""The shipped EAGLE head on the 4-bit SmolLM2 it was trained for: the proposer, fed the features
the decoder hands it, drafts the target's own next token on a chat reply the head never saw in
training; its draft vocabulary's logits are the target head's rows; bad weight files are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen import SamplingParams, SpeculativeConfig
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec
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
    for t in range(len(prompt) - 1, len(ids) - 2):
        proposer.observe_features(features[t])
        hits.append(proposer.propose(ids[: t + 2], 1, policy, None).tokens == [ids[t + 2]])
    assert sum(hits) / len(hits) >= 0.25, sum(hits) / len(hits)


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
    from safetensors.torch import load_file, save_file

    model = smollm2_q4.model
    tensors = load_file(str(SHIPPED_WEIGHTS))
    meta = {"hidden_size": str(model.config.hidden_size), "inner_size": str(tensors["fc1.weight"].shape[0])}
    no_vocab = {k: v for k, v in tensors.items() if k != "draft_vocab"}
    save_file(no_vocab, str(tmp_path / "a.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        load_eagle_head(tmp_path / "a.safetensors", model)
    head = load_eagle_head(None, model)
    head.draft_vocab[0] = model.config.vocab_size
    save_eagle_head(head, tmp_path / "b.safetensors", "smollm2")
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        load_eagle_head(tmp_path / "b.safetensors", model)
