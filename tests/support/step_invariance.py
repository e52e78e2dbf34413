"""The C steps' bit invariance, for any model they run: one check the families' tests share."""

from __future__ import annotations

import torch

from kvgen import LLM


def assert_steps_give_the_prompts_bits(llm: LLM, ids: list[int]) -> None:
    """Each decoded token's logits, each row's of verify-sized forwards (2 to 8 tokens) and of the
    whole prompt equal those of the prompt run at the default thread count, with 1, 2 or 3 threads."""

    def forward(tokens: list[int], cache) -> torch.Tensor:
        return llm.model(torch.tensor([tokens]), cache, logits_to_keep=len(tokens))[0]

    with torch.inference_mode():
        whole = forward(ids, llm.generator.new_cache(len(ids)))
    threads = torch.get_num_threads()
    for count in (1, 2, 3):
        torch.set_num_threads(count)
        try:
            with torch.inference_mode():
                cache = llm.generator.new_cache(len(ids))
                llm.model(torch.tensor([ids[:8]]), cache)
                steps = torch.stack([llm.model(torch.tensor([[token]]), cache)[0, -1] for token in ids[8:]])
                cache = llm.generator.new_cache(len(ids))
                starts = [8, 13, 21, 23, 31, 34, len(ids)]  # verifies of 5, 8, 2, 8, 3 and the rest
                verified = torch.cat([forward(ids[:8], cache)] + [forward(ids[a:b], cache) for a, b in zip(starts, starts[1:])])
                prompt = forward(ids, llm.generator.new_cache(len(ids)))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(steps, whole[8:]), (count, (steps - whole[8:]).abs().max().item())
        assert torch.equal(verified, whole), (count, (verified - whole).abs().max().item())
        assert torch.equal(prompt, whole), (count, (prompt - whole).abs().max().item())
