"""The EAGLE trainer's batches and loss (scripts/train_eagle.py), on synthetic replies: the features a
chain step distils from are those whose greedy token it learns, and distillation changes the loss
only through the target's distribution."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from train_eagle import Replies, chain_loss, teacher_features  # noqa: E402

from kvgen.speculative.eagle_head import EagleHead  # noqa: E402

HIDDEN, VOCAB = 16, 12


def synthetic_replies(rows: torch.Tensor) -> tuple[Replies, list[tuple[int, int]]]:
    """Two replies whose greedy ids are what `rows` gives each position's features (as extract() makes them)."""
    torch.manual_seed(0)
    feats = torch.randn(30, HIDDEN)
    greedy = (feats @ rows.T).argmax(-1)
    tokens = torch.randint(VOCAB, (30,))
    to_draft = torch.arange(VOCAB)
    return Replies(feats, tokens, greedy, torch.randn(VOCAB, HIDDEN), to_draft), [(2, 14), (16, 30)]


def test_teacher_features_give_each_chain_steps_label() -> None:
    rows = torch.randn(VOCAB, HIDDEN)
    data, spans = synthetic_replies(rows)
    f, x, f_next, labels, target = data.batch(spans, depth=3)
    for step in range(3):
        truth = teacher_features(f_next, step)
        assert truth.shape == f.shape
        live = target[step] >= 0
        assert live.sum() == sum(end - first - 1 - step for first, end in spans)
        assert torch.equal((truth[live] @ rows.T).argmax(-1), target[step][live])


def test_distillation_moves_the_loss_and_its_gradient() -> None:
    rows = torch.randn(VOCAB, HIDDEN)
    data, spans = synthetic_replies(rows)
    head = EagleHead(HIDDEN, 2, 1, 8, 32, torch.arange(VOCAB))
    batch = data.batch(spans, depth=2)
    norm = nn.Identity()
    hard, agree = chain_loss(head, norm, rows, torch.arange(VOCAB), batch, [1.0, 0.5])
    same, _ = chain_loss(head, norm, rows, torch.arange(VOCAB), batch, [1.0, 0.5], soft=0.0)
    soft, soft_agree = chain_loss(head, norm, rows, torch.arange(VOCAB), batch, [1.0, 0.5], soft=1.0)
    assert torch.equal(hard, same)  # soft=0: no distillation term
    assert not torch.isclose(hard, soft)
    assert agree == soft_agree  # agreement is with the greedy token either way
    soft.backward()
    assert all(p.grad is not None for p in (head.fc.weight, head.q.weight, head.down.weight))
