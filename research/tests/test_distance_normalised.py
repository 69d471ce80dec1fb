"""The distance-normalised ranking of the long-row study (research/long_fidelity.py, issue #36 item 4): a score over the
moving mean of its neighbours' divides out a smooth dependence on distance and keeps each token's standing among its
neighbours."""

from __future__ import annotations

import torch

from research.long_fidelity import distance_normalised


def test_a_smooth_trend_is_divided_out_and_the_local_contrast_kept():
    torch.manual_seed(0)
    T = 400
    trend = torch.exp(-((torch.arange(T) - 300.0) / 60.0) ** 2) + 0.05  # a peak, as the window edge makes
    local = torch.rand(T) + 0.5  # what each token is worth among its neighbours
    scores = torch.zeros(2, T + 10)
    reasoning = torch.zeros(2, T + 10, dtype=torch.bool)
    scores[0, 5:T + 5], reasoning[0, 5:T + 5] = trend * local, True
    scores[1, :20], reasoning[1, :20] = 3.0, True  # a constant row: every token alike
    out = distance_normalised(scores, reasoning, width=16)
    assert out[~reasoning].abs().sum() == 0
    torch.testing.assert_close(out[1, :20], torch.ones(20, dtype=torch.float64))
    v = out[0, reasoning[0]]
    corr = (lambda a, b: float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1]))
    assert corr(v, local) > 0.8 > corr(scores[0, reasoning[0]], local)  # the contrast, not the trend, ranks now
    assert abs(corr(v, trend)) < 0.2
