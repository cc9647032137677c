# SPDX-License-Identifier: Apache-2.0
"""``ESPProposer.observe_verification``: one step's verified blocks reach
both calibrations, the sources' acceptance and the mask rows' value, at
the price the cost model gives a row (on a hand-built batch, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_esp.core.batch import TreeBatch
from vllm_esp.core.goodput import (
    SOURCE_ESP,
    SOURCE_LOOKUP,
    AcceptanceCalibration,
    MaskValueCalibration,
    StepCostModel,
)
from vllm_esp.proposer import AutoStats, ESPProposer


def proposer(cost_model: StepCostModel | None):
    state = SimpleNamespace(calibration=AcceptanceCalibration(),
                            mask_calibration=MaskValueCalibration(0.1),
                            cost_model=cost_model, stats=AutoStats())
    return state, ESPProposer.observe_verification.__get__(state)


def two_blocks() -> tuple[TreeBatch, np.ndarray]:
    # Block 0: root -> e1 -> e2 (ESP candidates), root -> l1 (lookup);
    # masks (k = 2) on the root and on e1: 4 nodes + 4 mask rows.
    # Block 1: root -> l2 (lookup), no masks: 2 rows.
    parents = np.array([[-1, 0, 1, 0], [-1, 0, -1, -1]])
    masked = np.array([[True, True, False, False], [False] * 4])
    sources = np.array([[0, SOURCE_ESP, SOURCE_ESP, SOURCE_LOOKUP],
                        [0, SOURCE_LOOKUP, 0, 0]], np.int8)
    reach = np.array([[1.0, 0.6, 0.3, 0.2], [1.0, 0.5, 0.0, 0.0]], np.float32)
    trees = TreeBatch(parents, np.zeros((2, 4), np.int64), masked, np.array([4, 2]),
                      num_mask_tokens=2, reach=reach, sources=sources)
    chains = np.array([[0, 1, 2], [0, 1, 0]])
    return trees, chains


def test_observe_verification_prices_esp_drafts_and_counts_probed_blocks():
    # 10 rows, 2 requests, 3 tokens (2 roots + e1): 12 ms at 2 ms fixed and
    # 1 ms a row, so a row costs 3 / 12 ms * 1 ms = 0.25 tokens.
    cost_model = StepCostModel(fixed=0.002, per_row=0.001)
    assert cost_model.row_price(10, 2, 3) == pytest.approx(0.25)
    state, observe = proposer(cost_model)
    trees, chains = two_blocks()

    observe(trees, chains, np.array([1, 0]), probed=np.array([True, False]))

    # ESP drafted e1 and e2 (2 rows) and e1 was accepted: 1 - 2 * 0.25.
    assert state.mask_calibration.seeded == pytest.approx(1.0)
    assert state.mask_calibration.surplus == pytest.approx(0.5)
    assert state.mask_calibration.value == pytest.approx((0.5 + 5 * 0.1) / (1 + 5))
    # The sources' calibration saw the four drafted nodes' prior reach and
    # the one accepted.
    assert state.calibration.predicted.sum() == pytest.approx(0.6 + 0.3 + 0.2 + 0.5)
    assert state.calibration.accepted[SOURCE_ESP].sum() == pytest.approx(1.0)
    assert state.calibration.accepted[SOURCE_LOOKUP].sum() == 0.0


def test_blocks_not_probed_do_not_count_as_seeded():
    state, observe = proposer(StepCostModel(fixed=0.002, per_row=0.001))
    trees, chains = two_blocks()
    observe(trees, chains, np.array([1, 0]), probed=np.array([False, False]))
    assert state.mask_calibration.seeded == 0.0
    assert state.mask_calibration.surplus == pytest.approx(0.5)


def test_without_a_cost_model_the_mask_value_keeps_its_prior():
    state, observe = proposer(None)
    trees, chains = two_blocks()
    observe(trees, chains, np.array([1, 0]), probed=np.array([True, False]))
    assert state.mask_calibration.seeded == 0.0
    assert state.mask_calibration.value == pytest.approx(0.1)
    assert state.calibration.accepted.sum() == pytest.approx(1.0)


def test_the_periodic_log_counts_mask_rows_and_drafts_by_source(caplog):
    state, observe = proposer(StepCostModel(fixed=0.002, per_row=0.001))
    state.stats.interval = 0.0
    trees, chains = two_blocks()
    # Step 1: block 0 accepts e1 (ESP), block 1 accepts l2 (lookup).
    observe(trees, chains, np.array([1, 1]), probed=np.array([True, False]))
    # Step 2: nothing accepted.
    observe(trees, chains, np.array([0, 0]), probed=np.array([False, False]))
    with caplog.at_level("INFO", logger="vllm.esp"):
        state.stats.step(10, state)
    message = caplog.records[-1].getMessage()
    # Two steps of the two blocks: 4 blocks of (8 + 2) / 2 = 5 rows, of
    # which 2 x 4 are mask rows; ESP drafted e1 and e2 twice (e1 accepted
    # once), lookup l1 and l2 twice (l2 accepted once), cached answers none.
    assert "4 blocks of 5.0 rows (8 mask rows), 0.50 accepted per block" in message
    assert "by source: esp 1/4, lookup 1/4, cached answers 0/0;" in message
    # The counts start again after each log line.
    with caplog.at_level("INFO", logger="vllm.esp"):
        observe(trees, chains, np.array([2, 0]), probed=np.array([True, False]))
        state.stats.step(10, state)
    message = caplog.records[-1].getMessage()
    assert "1 steps" in message and "(4 mask rows)" in message
    assert "by source: esp 2/2, lookup 0/2, cached answers 0/0;" in message
