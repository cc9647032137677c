# SPDX-License-Identifier: Apache-2.0
"""Chi-square tests for the sampling tests: is a sampler's output the
target's distribution?"""

from __future__ import annotations

from collections import Counter

import torch


def _p_value(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))


def chi_square_homogeneity_p(first: Counter, second: Counter, min_expected=5.0) -> float:
    """Two-sample Pearson chi-square p-value; rare cells are pooled."""
    total_first, total_second = sum(first.values()), sum(second.values())
    cells, pooled = [], [0, 0]
    for key in set(first) | set(second):
        a, b = first.get(key, 0), second.get(key, 0)
        expected = (a + b) * min(total_first, total_second) / (total_first + total_second)
        if expected < min_expected:
            pooled[0] += a
            pooled[1] += b
        else:
            cells.append((a, b))
    if sum(pooled):
        cells.append(tuple(pooled))
    statistic = 0.0
    for a, b in cells:
        expected_a = (a + b) * total_first / (total_first + total_second)
        expected_b = (a + b) * total_second / (total_first + total_second)
        statistic += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    return _p_value(statistic, max(len(cells) - 1, 1))


def chi_square_goodness_p(samples: list, expected: dict, min_expected=5.0) -> float:
    """One-sample Pearson chi-square p-value of ``samples`` against the exact
    distribution ``expected`` (outcome -> probability); outcomes expected
    fewer than ``min_expected`` times are pooled."""
    n = len(samples)
    observed = Counter(samples)
    statistic, cells, pooled_observed, pooled_expected = 0.0, 0, 0, 0.0
    for outcome, probability in expected.items():
        if n * probability < min_expected:
            pooled_observed += observed.get(outcome, 0)
            pooled_expected += n * probability
            continue
        statistic += (observed.get(outcome, 0) - n * probability) ** 2 / (n * probability)
        cells += 1
    if pooled_expected:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    return _p_value(statistic, max(cells - 1, 1))
