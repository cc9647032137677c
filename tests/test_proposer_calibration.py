# SPDX-License-Identifier: Apache-2.0
"""``ESPProposer.observe_verification``: one step's verified blocks reach
both calibrations, the sources' acceptance and the mask rows' value, at
the price the cost model gives a row, each in its request's sampling band
(on a hand-built batch, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_esp.core.batch import TreeBatch
from vllm_esp.core.goodput import (
    NUM_SAMPLING_BANDS,
    SOURCE_ESP,
    SOURCE_LOOKUP,
    SamplingCalibration,
    StepCostModel,
    sampling_bands,
)
from vllm_esp.proposer import DRAIN_STEPS, WAVE_STEPS, AutoStats, ESPProposer


def proposer(cost_model: StepCostModel | None, temperatures=(0.0, 0.0)):
    """An observer of two blocks, in slots 0 and 1, of requests sampling at
    ``temperatures``; ``state.calibration`` and ``state.mask_calibration``
    are the greedy band's."""
    state = SimpleNamespace(calibration=SamplingCalibration(0.1),
                            sampling_band=sampling_bands(np.array(temperatures)),
                            cost_model=cost_model, stats=AutoStats())
    observe_verification = ESPProposer.observe_verification.__get__(state)

    def observe(trees, chains, accepted, probed):
        observe_verification(trees, chains, accepted, probed, np.array([0, 1]))

    greedy = SimpleNamespace(calibration=state.calibration.acceptance[0],
                             mask_calibration=state.calibration.mask[0],
                             stats=state.stats, calibration_bands=state.calibration)
    return greedy, observe


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
        state.stats.step(10, SimpleNamespace(calibration=state.calibration_bands,
                                             cost_model=None))
    message = caplog.records[-1].getMessage()
    # Two steps of the two blocks: 4 blocks of (8 + 2) / 2 = 5 rows, of
    # which 2 x 4 are mask rows; ESP drafted e1 and e2 twice (e1 accepted
    # once), lookup l1 and l2 twice (l2 accepted once), cached answers none.
    assert "4 blocks of 5.0 rows (8 mask rows), 0.50 accepted per block" in message
    assert "by source: esp 1/4, lookup 1/4, cached answers 0/0;" in message
    # The counts start again after each log line.
    with caplog.at_level("INFO", logger="vllm.esp"):
        observe(trees, chains, np.array([2, 0]), probed=np.array([True, False]))
        state.stats.step(10, SimpleNamespace(calibration=state.calibration_bands,
                                             cost_model=None))
    message = caplog.records[-1].getMessage()
    assert "1 steps" in message and "(4 mask rows)" in message
    assert "by source: esp 2/2, lookup 0/2, cached answers 0/0;" in message


def test_each_sampling_band_is_calibrated_apart():
    """A greedy request's block and a block sampled at T = 0.7 in one step:
    the lookup draft of the sampled block (accepted) and the ESP drafts of
    the greedy one (one accepted) land in their own bands' calibrations;
    the other bands stay at their priors, and the log shows the two
    observed bands."""
    state, observe = proposer(StepCostModel(fixed=0.002, per_row=0.001),
                              temperatures=(0.0, 0.7))
    bands = state.calibration_bands
    trees, chains = two_blocks()
    observe(trees, chains, np.array([1, 1]), probed=np.array([True, False]))
    sampled = int(sampling_bands(np.array([0.7]))[0])
    assert sampled != 0
    greedy_cal, sampled_cal = bands.acceptance[0], bands.acceptance[sampled]
    # Greedy block: e1, e2 (ESP) and l1 (lookup) drafted, e1 accepted.
    assert greedy_cal.predicted[SOURCE_ESP].sum() == pytest.approx(0.9)
    assert greedy_cal.predicted[SOURCE_LOOKUP].sum() == pytest.approx(0.2)
    assert greedy_cal.accepted[SOURCE_LOOKUP].sum() == 0.0
    # Sampled block: l2 drafted and accepted, no ESP drafts.
    assert sampled_cal.predicted[SOURCE_LOOKUP].sum() == pytest.approx(0.5)
    assert sampled_cal.accepted[SOURCE_LOOKUP].sum() == pytest.approx(1.0)
    assert sampled_cal.predicted[SOURCE_ESP].sum() == 0.0
    # Only the greedy block was probed: the sampled band's mask value has
    # seen no seeded block.
    assert bands.mask[0].seeded == pytest.approx(1.0)
    assert bands.mask[sampled].seeded == 0.0
    others = [band for band in range(NUM_SAMPLING_BANDS) if band not in (0, sampled)]
    for band in others:
        assert bands.acceptance[band].predicted.sum() == 0.0
        assert (bands.scales[band] == 1.0).all()
    assert bands.observed_bands() == [0, sampled]
    assert bands.scales[sampled, SOURCE_LOOKUP].max() > 1.0
    assert bands.scales[0, SOURCE_LOOKUP].min() < 1.0


def test_the_periodic_log_shows_each_observed_band(caplog):
    state, observe = proposer(StepCostModel(fixed=0.002, per_row=0.001),
                              temperatures=(0.0, 1.0))
    state.stats.interval = 0.0
    trees, chains = two_blocks()
    observe(trees, chains, np.array([1, 1]), probed=np.array([True, False]))
    with caplog.at_level("INFO", logger="vllm.esp"):
        state.stats.step(10, SimpleNamespace(calibration=state.calibration_bands,
                                             cost_model=None))
    message = caplog.records[-1].getMessage()
    assert "greedy: esp x" in message and "T>=0.9: esp x" in message
    assert "T<0.5" not in message and "T 0.5-0.9" not in message


def test_sampling_bands_follow_vllm_greedy_threshold():
    assert sampling_bands(np.array([0.0, 1e-6, 0.3, 0.5, 0.7, 0.9, 1.0, 1.5])).tolist() == [
        0, 0, 1, 2, 2, 3, 3, 3]


def drain_state(num_requests_limit=4, steps_since_admission=DRAIN_STEPS,
                decode_steps=(15, 10)):
    cost_model = StepCostModel(fixed=0.050, per_row=0.002)
    cost_model.per_request = 0.0016
    state = SimpleNamespace(
        auto=True, cost_model=cost_model, max_num_seqs=num_requests_limit,
        steps_since_admission=steps_since_admission, stats=AutoStats(),
        runner=SimpleNamespace(input_batch=SimpleNamespace(num_prompt_tokens=np.array([10, 10]))),
        max_tokens=np.array([128, 128]), decode_steps=np.array(decode_steps),
        block_rows=np.array([2 * (decode_steps[0] - 1), decode_steps[1] - 1]))
    return state, ESPProposer._drain_values.__get__(state)


def test_draining_prices_tokens_by_the_requests_remaining_steps():
    """Two requests in four seats, none admitted for DRAIN_STEPS proposals:
    30 tokens in 15 steps leaves 98 at 2 a step (49 steps), 10 in 10 leaves
    118 at 1 a step (118 steps). Only the second is critical: its tokens
    also save the step's fixed cost, the first's only its own part of a
    step (1.6 ms and 2 rows at 2 ms, in its 14 blocks so far). A token
    saves the fraction of a step its request makes: 1/2 and 1/1."""
    state, drain_values = drain_state()
    values = drain_values(np.array([0, 1]), np.array([0, 1]), np.array([40, 20]), 2)
    np.testing.assert_allclose(values, [(0.0016 + 2 * 0.002) / 2, 0.0016 + 0.002 + 0.050])
    assert state.stats.draining_steps == 1


def test_no_draining_while_seats_are_full_or_requests_arrive():
    """Full seats: someone waits. A request admitted 5 proposals after the
    other and fewer than DRAIN_STEPS ago: requests are still arriving."""
    _, drain_values = drain_state(num_requests_limit=2)
    assert drain_values(np.array([0, 1]), np.array([0, 1]), np.array([40, 20]), 2) is None
    state, drain_values = drain_state(steps_since_admission=DRAIN_STEPS - 1)
    assert drain_values(np.array([0, 1]), np.array([0, 1]), np.array([40, 20]), 2) is None
    assert state.stats.draining_steps == 0


def test_one_wave_drains_from_its_first_steps():
    """Requests that all started within WAVE_STEPS proposals of each other
    (an offline generate of fewer prompts than seats) drain at once, even
    though one was admitted only WAVE_STEPS proposals ago."""
    state, drain_values = drain_state(steps_since_admission=WAVE_STEPS,
                                      decode_steps=(WAVE_STEPS + 2, 2))
    values = drain_values(np.array([0, 1]), np.array([0, 1]), np.array([40, 20]), 2)
    assert values is not None and state.stats.draining_steps == 1
    late, drain_values = drain_state(steps_since_admission=WAVE_STEPS,
                                     decode_steps=(WAVE_STEPS + 3, 2))
    assert drain_values(np.array([0, 1]), np.array([0, 1]), np.array([40, 20]), 2) is None
