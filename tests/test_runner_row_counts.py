# SPDX-License-Identifier: Apache-2.0
"""The ESP runner's row counts (``esp_row_counts``, read by the benchmarks'
rows-per-step column) and the decode-only test that also gates the 'auto'
cost model's timing, on hand-made scheduler outputs; what the cost
model's start-up profile times, on a fake runner; and the chain metadata
the rejection sampler reads, compacted or in place."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_esp.runner import ESPModelRunnerMixin


def counter():
    runner = SimpleNamespace(_esp_decode_request_steps=0, _esp_decode_rows=0)
    count = ESPModelRunnerMixin._count_decode_rows.__get__(runner)
    rows = ESPModelRunnerMixin.esp_row_counts.__get__(runner)
    return count, rows


def step(scheduled: dict[str, int], drafts: dict[str, list[int]]):
    return SimpleNamespace(num_scheduled_tokens=scheduled,
                           scheduled_spec_decode_tokens=drafts,
                           total_num_scheduled_tokens=sum(scheduled.values()))


def test_decode_only_step_counts_every_request_and_row():
    count, rows = counter()
    # a: a 6-row block (root + 5 draft slots); b: a plain step.
    assert count(step({"a": 6, "b": 1}, {"a": [1, 2, 3, 4, 5]})) == 7
    assert rows() == {"decode_request_steps": 2, "rows": 7}


def test_prefill_chunk_is_not_a_decode_row():
    count, rows = counter()
    # c prefills 40 tokens beside a's 3-row block and b's plain step: the
    # step is not decode-only (0: the cost model skips it), and only a and
    # b count.
    assert count(step({"a": 3, "b": 1, "c": 40}, {"a": [7, 8]})) == 0
    assert rows() == {"decode_request_steps": 2, "rows": 4}
    count(step({"a": 1}, {}))
    assert rows() == {"decode_request_steps": 3, "rows": 5}


def test_empty_step_counts_nothing():
    count, rows = counter()
    assert count(step({}, {})) == 0
    assert rows() == {"decode_request_steps": 0, "rows": 0}


def test_step_cost_profile_times_the_lm_head_over_every_row():
    """A verification step computes logits for all its rows, so the 'auto'
    cost model's start-up profile must time the LM head over every row of
    each profiled forward (without it, the prior per-row cost was about half
    of what decode steps measured)."""
    import torch

    from vllm_esp.runner import PROFILE_REPEATS, PROFILE_TOKENS

    forwards, logits_rows = [], []

    def dummy_run(num_tokens, force_attention=False):
        forwards.append(num_tokens)
        hidden_states = torch.zeros(num_tokens, 4)
        return hidden_states, hidden_states[-1:]

    runner = SimpleNamespace(
        max_num_tokens=64, scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        _esp_tensor_parallel=False, _dummy_run=dummy_run,
        model=SimpleNamespace(compute_logits=lambda h: logits_rows.append(h.shape[0])))
    runner._esp_forward_with_logits = ESPModelRunnerMixin._esp_forward_with_logits.__get__(
        runner)
    points = ESPModelRunnerMixin._esp_time_forwards(runner)
    profiled = [n for n in PROFILE_TOKENS if n <= 64]
    assert [p[0] for p in points] == profiled
    assert all(p[1] > 0 for p in points)
    assert forwards == logits_rows
    assert forwards == [n for n in profiled for _ in range(PROFILE_REPEATS + 1)]


def test_chain_metadata_carries_the_chain_layout():
    """The runner's SpecDecodeMetadata is the core's chain layout, as is."""
    import numpy as np
    import torch

    from vllm_esp.core.batch import chain_rows
    from vllm_esp.runner import chain_spec_decode_metadata

    layout = chain_rows(np.array([1]), np.array([0, 3]), np.array([2, 9]),
                        np.array([7, 8] + [0] * 9), np.array([[0, 2, 0]]), np.array([2]),
                        np.array([[5, 9, 4]]), in_place=True)
    metadata = chain_spec_decode_metadata(layout, torch.device("cpu"))
    assert metadata.draft_token_ids.tolist() == [7, 8, 4]
    assert metadata.num_draft_tokens == [2, 1]
    assert metadata.cu_num_draft_tokens.tolist() == [2, 3]
    assert metadata.cu_num_sampled_tokens.tolist() == [3, 5]
    assert metadata.target_logits_indices.tolist() == [0, 1, 3]
    assert metadata.bonus_logits_indices.tolist() == [2, 5]
    assert metadata.logits_indices.tolist() == [0, 1, 2, 3, 5]
    assert metadata.target_logits_indices.dtype == torch.int32
