# SPDX-License-Identifier: Apache-2.0
"""Blocks near ``max_model_len`` and under KV pressure, in the engine.

* Context edge: vLLM stops drafting for the *whole batch* once the longest
  request plus ``num_speculative_tokens`` passes ``max_model_len``. ESP
  shrinks each request's block to what fits instead, so requests that end
  exactly at ``max_model_len`` still accept drafts in their last block-size
  positions, and the other requests keep speculating meanwhile.
* KV pressure: with a KV cache too small for the batch, greedy outputs stay
  identical to plain vLLM's, and ESP's blocks yield to KV needs (the
  scheduler drops drafts before it would preempt for them).
"""

from __future__ import annotations

import pytest

from vllm_esp_dev.runs import generate, make_llm, run_once, shutdown

pytestmark = pytest.mark.vllm

# A fixed hybrid block, so that the test does not depend on the machine's
# step costs ('auto' shrinks blocks the same way: row caps per request).
HYBRID_30 = {"method": "esp", "block_complexity": 30, "candidates": ["esp", "ngram"]}
MAX_MODEL_LEN = 320


def _steps_without_drafts(output_len: int, metrics: dict) -> int:
    """Decode steps of a request that verified no drafts: every output token
    comes from the prefill (1), a verification step (1 + accepted), or a
    plain step (1)."""
    accepted = metrics["per_step_accepted"]
    return output_len - 1 - sum(1 + a for a in accepted)


def _steps_in_last_positions(output_len: int, metrics: dict, last: int) -> list[int]:
    """Indices of a request's verification steps that start within its
    last ``last`` output positions."""
    position, steps = 1, []  # the prefill emits the first token
    for step, accepted in enumerate(metrics["per_step_accepted"]):
        if position >= output_len - last:
            steps.append(step)
        position += 1 + accepted
    return steps


def test_requests_at_max_model_len_keep_speculating(smollm2_dir, bundled_prompts):
    from vllm import SamplingParams

    # The longest prompt ends exactly at max_model_len; two short ones stay
    # far from it and run longer, so they decode while the long one is in
    # its last block-size positions.
    by_length = sorted(bundled_prompts, key=len)
    edge_prompts, other_prompts = by_length[-1:], by_length[:2]
    prompts = edge_prompts + other_prompts
    params = ([SamplingParams(temperature=0.0, ignore_eos=True,
                              max_tokens=MAX_MODEL_LEN - len(p)) for p in edge_prompts]
              + [SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=MAX_MODEL_LEN - len(edge_prompts[0]) + 40)
                 for _ in other_prompts])
    assert all(len(p) + s.max_tokens < MAX_MODEL_LEN - 64
               for p, s in zip(other_prompts, params[1:]))
    kwargs = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    plain = run_once(smollm2_dir, prompts, params, **kwargs)
    llm = make_llm(smollm2_dir, HYBRID_30, per_request_spec_decode_metrics="detailed",
                   **kwargs)
    try:
        rows_before = llm.collective_rpc("esp_row_counts")[0]
        esp = generate(llm, prompts, params)
        rows_after = llm.collective_rpc("esp_row_counts")[0]
    finally:
        shutdown(llm)
    assert esp.token_ids == plain.token_ids
    # The benchmarks' forwards: the front end's count of the steps that
    # emitted each request's tokens is one per token without speculation,
    # and with ESP (plain steps, cut and truncated blocks included) agrees
    # with the worker's own count of decode request-steps.
    assert plain.emitting_steps == [len(tokens) for tokens in plain.token_ids]
    decode_steps = rows_after["decode_request_steps"] - rows_before["decode_request_steps"]
    assert sum(steps - 1 for steps in esp.emitting_steps) == decode_steps
    assert all(steps >= 1 + len(m["per_step_accepted"])
               for steps, m in zip(esp.emitting_steps, esp.spec_metrics))
    assert len(edge_prompts[0]) + len(esp.token_ids[0]) == MAX_MODEL_LEN

    block = HYBRID_30["block_complexity"]
    for index, (tokens, metrics) in enumerate(zip(esp.token_ids, esp.spec_metrics)):
        assert metrics is not None
        # ESP only loses the last rows, where not even a root and one draft
        # fit (and a first step or so).
        assert _steps_without_drafts(len(tokens), metrics) <= 4, (index, metrics)
    # All three requests are prefilled in the first step and decode together,
    # so step i of one request is step i of the others. In the steps where
    # the edge request is within one block of max_model_len, it still accepts
    # drafts, and so do the other requests. (vLLM's rule would verify no
    # drafts at all in those steps, for every request.)
    zone = _steps_in_last_positions(len(esp.token_ids[0]), esp.spec_metrics[0], block)
    assert len(zone) >= 5
    accepted = [esp.spec_metrics[i]["per_step_accepted"] for i in range(len(prompts))]
    assert sum(accepted[0][step] for step in zone) > 0
    assert sum(accepted[i][step] for i in range(1, len(prompts)) for step in zone) > 0


def test_kv_pressure_outputs_identical_and_preemptions_counted(smollm2_dir, bundled_prompts):
    from vllm import SamplingParams

    prompts = bundled_prompts[:8]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    # 14 blocks of 32 tokens (one is vLLM's null block) hold about 3 of
    # these requests (45 to 76 prompt tokens) at their full length: the
    # scheduler must preempt.
    kwargs = dict(max_num_seqs=8, block_size=32, num_gpu_blocks_override=14,
                  max_model_len=384, enable_prefix_caching=False)
    runs = {}
    # A fixed 30-row block makes the pressure ESP adds visible; 'auto' sizes
    # blocks smaller at this batch anyway.
    for label, spec in (("plain", None), ("esp", HYBRID_30)):
        llm = make_llm(smollm2_dir, spec, **kwargs)
        try:
            run = generate(llm, prompts, params, label=label)
            preemptions = sum(m.value for m in llm.get_metrics()
                              if m.name == "vllm:num_preemptions")
        finally:
            shutdown(llm)
        runs[label] = (run, preemptions)
    (plain, plain_preempted), (esp, esp_preempted) = runs["plain"], runs["esp"]
    print(f"preemptions under KV pressure: plain {plain_preempted}, ESP {esp_preempted}")
    assert esp.token_ids == plain.token_ids
    assert plain_preempted > 0  # the cache really is too small
    assert esp.num_drafts > 0
    # Blocks yield to KV needs: ESP preempts about as often as plain vLLM.
    assert esp_preempted <= plain_preempted + 3
