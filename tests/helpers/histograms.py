"""Per-position token histograms of sampled completions and the chi-squared homogeneity test the sampling tests put
them to (speculative decoding must leave the distribution of every position as it is)."""

from __future__ import annotations

import torch


def position_histograms(completions: list[list[int]], positions: int, vocab_size: int) -> torch.Tensor:
    """(positions, vocab_size) counts of each token id at each completion position; a completion shorter than
    `positions` (it ended) counts token 0 (padding) at the positions after its end."""
    padded = torch.zeros(len(completions), positions, dtype=torch.long)
    for row, ids in enumerate(completions):
        ids = list(ids)[:positions]
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return torch.nn.functional.one_hot(padded, vocab_size).sum(0)


def homogeneity_p_values(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Chi-squared test that two samples' (positions, categories) histograms come from one distribution: the p-value
    of each position (categories empty on both sides dropped)."""
    p_values = []
    for a, b in zip(first.double(), second.double(), strict=True):
        seen = (a + b) > 0
        table = torch.stack([a[seen], b[seen]])
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        statistic = ((table - expected) ** 2 / expected).sum()
        dof = int(seen.sum()) - 1
        p_values.append(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2) if dof > 0 else 1.0)
    return torch.tensor(p_values)


def goodness_of_fit_p_value(counts: torch.Tensor, probabilities: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-squared test that `counts` (categories) were drawn from `probabilities`: the categories expected fewer than
    `min_expected` times pooled into one (the test's validity condition), then the p-value of the statistic."""
    counts, probabilities = counts.double(), probabilities.double() / probabilities.double().sum()
    expected = probabilities * counts.sum()
    kept = expected >= min_expected
    observed_bins = torch.cat([counts[kept], counts[~kept].sum().reshape(1)])
    expected_bins = torch.cat([expected[kept], expected[~kept].sum().reshape(1)])
    used = expected_bins > 0
    statistic = ((observed_bins[used] - expected_bins[used]) ** 2 / expected_bins[used]).sum()
    dof = int(used.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))
