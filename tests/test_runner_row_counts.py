# SPDX-License-Identifier: Apache-2.0
"""The ESP runner's row counts (``esp_row_counts``, read by the benchmarks'
rows-per-step column) and the decode-only test that also gates the 'auto'
cost model's timing, on hand-made scheduler outputs; what the cost
model's start-up profile times, on a fake runner; and the chain metadata
the rejection sampler reads, compacted or in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_esp.runner import ESPModelRunnerMixin


def counter():
    runner = SimpleNamespace(_esp_decode_request_steps=0, _esp_decode_rows=0, _esp_walk_steps=0,
                             _esp_undrafted_steps=0, _esp_argmax_steps=0)
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
    assert rows() == {"decode_request_steps": 2, "rows": 7, "walk_steps": 0,
                      "steps_without_drafts": 0, "argmax_steps": 0}


def test_prefill_chunk_is_not_a_decode_row():
    count, rows = counter()
    # c prefills 40 tokens beside a's 3-row block and b's plain step: the
    # step is not decode-only (0: the cost model skips it), and only a and
    # b count.
    assert count(step({"a": 3, "b": 1, "c": 40}, {"a": [7, 8]})) == 0
    assert rows() == {"decode_request_steps": 2, "rows": 4, "walk_steps": 0,
                      "steps_without_drafts": 0, "argmax_steps": 0}
    count(step({"a": 1}, {}))
    assert rows() == {"decode_request_steps": 3, "rows": 5, "walk_steps": 0,
                      "steps_without_drafts": 0, "argmax_steps": 0}


def test_empty_step_counts_nothing():
    count, rows = counter()
    assert count(step({}, {})) == 0
    assert rows() == {"decode_request_steps": 0, "rows": 0, "walk_steps": 0,
                      "steps_without_drafts": 0, "argmax_steps": 0}


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


class FakeClock:
    """``time.perf_counter`` for a fake runner whose forwards take
    ``load * cost(num_tokens)`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.load = 1.0

    def __call__(self) -> float:
        return self.now


def profiling_runner(clock: FakeClock, forwards: list[int]):
    """A fake runner with what ``esp_profile_step_cost`` reads; a forward of
    ``n`` tokens takes ``load * (30 ms + 2 ms * n)``."""
    import torch  # noqa: F401  (the cache key reads torch's thread count)

    def forward(num_tokens):
        forwards.append(num_tokens)
        clock.now += clock.load * (0.030 + 0.002 * num_tokens)

    runner = SimpleNamespace(
        esp_config=SimpleNamespace(auto=True),
        model_config=SimpleNamespace(model="fake-model", dtype="float32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        max_num_tokens=256, scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
        _esp_tensor_parallel=False, _esp_forward_with_logits=forward,
        drafter=SimpleNamespace(cost_model=None))
    for name in ("_esp_time_forwards", "esp_profile_step_cost"):
        setattr(runner, name, getattr(ESPModelRunnerMixin, name).__get__(runner))
    return runner


def test_step_cost_profile_is_cached_and_redone_when_taken_under_load(tmp_path, monkeypatch):
    """The 'auto' prior comes from a profile cached per model and machine.
    A profile taken while the machine was busy (every forward 1.6x slower)
    must not stay the prior for good: the next start times one point again,
    finds the cache too slow, profiles again and keeps the lower times. A
    start that is itself the busy one keeps the quiet cache."""
    import vllm_esp.runner as runner_module
    from vllm_esp.runner import PROFILE_CHECK_TOKENS, PROFILE_REPEATS, PROFILE_TOKENS

    clock = FakeClock()
    monkeypatch.setattr(runner_module.time, "perf_counter", clock)
    monkeypatch.setattr(runner_module, "cache_root", lambda: tmp_path)
    one_point = [PROFILE_CHECK_TOKENS] * (PROFILE_REPEATS + 1)
    full_profile = [n for n in PROFILE_TOKENS for _ in range(PROFILE_REPEATS + 1)]

    def start(load):
        clock.load = load
        forwards = []
        runner = profiling_runner(clock, forwards)
        runner.esp_profile_step_cost()
        return runner.drafter.cost_model, forwards

    # First start, under load: profiled and cached at 1.6x the quiet cost.
    model, forwards = start(1.6)
    assert forwards == full_profile
    assert model.fixed == pytest.approx(1.6 * 0.030) and model.per_row == pytest.approx(1.6 * 0.002)
    # Quiet start: the check finds the cache 1.6x too slow, profiles again.
    model, forwards = start(1.0)
    assert forwards == one_point + full_profile
    assert model.fixed == pytest.approx(0.030) and model.per_row == pytest.approx(0.002)
    # Quiet again: the cache holds, only the check runs.
    model, forwards = start(1.0)
    assert forwards == one_point
    assert model.fixed == pytest.approx(0.030)
    # A busy start keeps the quiet cache (load only adds time).
    model, forwards = start(1.6)
    assert forwards == one_point
    assert model.fixed == pytest.approx(0.030)
    assert len(list(tmp_path.glob("step-cost/*.json"))) == 1


def test_step_cost_profile_cache_that_is_not_a_profile_is_measured_again():
    from vllm_esp.runner import merged_profile, parse_profile, profile_is_stale

    assert parse_profile('{"points": [[1, 0.03], [8, 0.05]]}') == [[1.0, 0.03], [8.0, 0.05]]
    for text in ("", "[]", '{"points": []}', '{"points": [[1, -0.1]]}',
                 '{"points": [[1, 0.1, 2]]}', '{"points": [[1, "x"]]}',
                 '{"points": [[0, 0.1]]}', '{"points": [[1, NaN]]}', '{"points": 3}'):
        assert parse_profile(text) is None, text
    cached = [[1.0, 0.05], [8.0, 0.09]]
    assert profile_is_stale(cached, [8.0, 0.06])          # cache 1.5x the check
    assert not profile_is_stale(cached, [8.0, 0.08])      # within noise
    assert not profile_is_stale(cached, [8.0, 0.20])      # this start is the busy one
    assert not profile_is_stale(cached, [32.0, 0.01])     # nothing cached to compare
    assert merged_profile(cached, [[8.0, 0.06], [32.0, 0.2]]) == [
        [1.0, 0.05], [8.0, 0.06], [32.0, 0.2]]
    # A slower new time never replaces a cached one (load only adds time).
    assert merged_profile(cached, [[8.0, 0.12]]) == cached


def test_a_step_without_drafts_skips_the_rejection_sampler():
    """With a speculative config vLLM sends every step through its
    RejectionSampler, whose sampled path draws a batch x vocabulary noise
    tensor even when no request has drafts (17 ms a step at batch 24 on
    SmolLM2). ESP's runner samples such a step with vLLM's Sampler, as an
    engine without speculation does; steps with drafts still go to vLLM
    (or to ESP's own verification)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    calls = []

    class VLLMRunner:
        def _sample(self, logits, spec_decode_metadata):
            calls.append("rejection sampler")
            return "verified"

    class Runner(ESPModelRunnerMixin, VLLMRunner):
        pass

    runner = object.__new__(Runner)
    runner._esp_step = None
    runner._esp_undrafted_steps = 0
    runner.input_batch = SimpleNamespace(
        update_async_output_token_ids=lambda: calls.append("async outputs"),
        sampling_metadata="metadata")

    def sampler(logits, sampling_metadata):
        calls.append(("sampler", logits, sampling_metadata))
        return "sampled"

    runner.sampler = sampler
    no_drafts = SpecDecodeMetadata.make_dummy([[], []], device="cpu")
    assert no_drafts.max_spec_len == 0
    assert runner._sample("logits", no_drafts) == "sampled"
    assert calls == ["async outputs", ("sampler", "logits", "metadata")]
    assert runner._esp_undrafted_steps == 1
    calls.clear()
    with_drafts = SpecDecodeMetadata.make_dummy([[5], []], device="cpu")
    assert runner._sample("logits", with_drafts) == "verified"
    assert runner._sample("logits", None) == "verified"
    assert calls == ["rejection sampler", "rejection sampler"]
    assert runner._esp_undrafted_steps == 1
