"""Anchor sampling (docs/design/training.md, "Anchors"). Legend: B batch, S seq, A anchors."""

import pytest
import torch

from deepspec.models.anchors import anchor_candidates, sample_anchors


def test_candidates_match_loop():
    g = torch.Generator().manual_seed(0)
    lm = (torch.rand(3, 20, generator=g) > 0.4).to(torch.uint8)
    got = anchor_candidates(lm)
    for b in range(3):
        for a in range(20):
            exp = a + 1 < 20 and bool(lm[b, a]) and bool(lm[b, a + 1])
            assert bool(got[b, a]) == exp


def test_sample_properties_and_padding():
    lm = torch.zeros(2, 16, dtype=torch.uint8)
    lm[0, 3:12] = 1  # candidates 3..10 (8)
    lm[1, 14:16] = 1  # candidate 14 only
    ap, valid = sample_anchors(lm, 5, torch.Generator().manual_seed(1))
    assert ap.dtype == torch.int64 and valid.dtype == torch.bool and ap.shape == (2, 5)
    assert valid[0].all() and valid[1].tolist() == [True, False, False, False, False]
    a0 = ap[0].tolist()
    assert a0 == sorted(a0) and len(set(a0)) == 5 and all(3 <= a <= 10 for a in a0)
    assert ap[1].tolist() == [14, 0, 0, 0, 0]


def test_more_anchors_than_positions_and_no_candidates():
    lm = torch.ones(1, 4)
    ap, valid = sample_anchors(lm, 10, torch.Generator().manual_seed(0))
    assert ap.shape == (1, 10) and valid.sum() == 3 and ap[0, :3].tolist() == [0, 1, 2]
    ap, valid = sample_anchors(torch.zeros(2, 6), 3, torch.Generator().manual_seed(0))
    assert not valid.any() and (ap == 0).all()


def test_uniform_and_deterministic():
    lm = torch.ones(1, 9)  # 8 candidates
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(9)
    for _ in range(400):
        ap, _ = sample_anchors(lm, 2, g)
        counts.index_add_(0, ap[0], torch.ones(2))
    assert counts[8] == 0
    frac = counts[:8] / counts[:8].sum()
    assert (frac - 1 / 8).abs().max() < 0.05
    a1 = sample_anchors(lm, 3, torch.Generator().manual_seed(7))[0]
    a2 = sample_anchors(lm, 3, torch.Generator().manual_seed(7))[0]
    assert torch.equal(a1, a2)


def test_errors():
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.ones(1, 4), 0)
    with pytest.raises(ValueError, match="loss_mask_BS"):
        sample_anchors(torch.ones(4), 2)
