# SPDX-License-Identifier: Apache-2.0
"""A fault in any phase of ESP's own step leaves the engine serving and the
output lossless (``vllm_esp.containment``).

For each phase, an injected exception (``vllm_esp_dev.faults.inject_fault``)
strikes a few steps into a batch of greedy requests on SmolLM2. The outputs
must equal plain vLLM's, the error must be logged once with the phase (and,
where the phase concerns requests, their ids), and the engine must serve
the next requests with drafts again. Without the
phase's guard the exception ends the engine (``generate`` raises), and
where the guard's fallback were wrong, the outputs would differ: the KV
relocation fault skips the copy, the block-input fault strikes after the
tree positions were written, the verification fault after the draws."""

from __future__ import annotations

import logging

import pytest

from vllm_esp_dev.faults import InjectedFault, inject_fault
from vllm_esp_dev.runs import generate, make_llm, run_once, shutdown

pytestmark = pytest.mark.vllm

MAX_TOKENS = 24
# A fixed block, so that every request drafts whatever this machine's step
# costs are ('auto' may give a request no draft rows).
CONFIG = {"method": "esp", "block_complexity": 10, "candidates": ["esp", "ngram"]}


def _phases():
    from vllm_esp.attention import ESPCPUAttentionMetadataBuilder
    from vllm_esp.proposer import ESPProposer
    from vllm_esp.runner import ESPModelRunnerMixin
    from vllm_esp.scheduler import ESPScheduler

    # (phase as logged, owner, method, run the original first, names requests)
    return {
        "fitting blocks to free KV": (ESPScheduler, "_fit_drafts_to_free_kv", False, False),
        "recording blocks": (ESPScheduler, "_record_blocks", False, False),
        "counting tree nodes": (ESPScheduler, "_step_counts", False, False),
        "the request slots": (ESPProposer, "slots", False, False),
        "the tree node counts": (ESPProposer, "tree_node_counts", False, False),
        "the block inputs": (ESPModelRunnerMixin, "_esp_write_inputs", True, True),
        "the tree-attention metadata": (ESPCPUAttentionMetadataBuilder, "_split", False, True),
        "the verification": (ESPModelRunnerMixin, "_esp_verify", True, True),
        "the KV relocation": (ESPModelRunnerMixin, "_relocate_kv", False, True),
        "the mask probe": (ESPModelRunnerMixin, "_esp_probe_masks", False, True),
        "forgetting finished requests": (ESPProposer, "drop", False, False),
    }


PHASES = ["fitting blocks to free KV", "recording blocks", "counting tree nodes",
          "the request slots", "the tree node counts", "the block inputs",
          "the tree-attention metadata", "the verification", "the KV relocation",
          "the mask probe", "forgetting finished requests"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def prompts(bundled_prompts):
    return [list(p) for p in bundled_prompts[:6]]


@pytest.fixture(scope="module")
def plain(smollm2_dir, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return run_once(smollm2_dir, prompts, params, label="plain", max_num_seqs=8)


def test_every_phase_is_listed():
    assert sorted(_phases()) == sorted(PHASES)


@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_in_each_phase_leaves_the_output_and_the_engine(
        smollm2_dir, prompts, plain, phase, monkeypatch):
    from vllm import SamplingParams

    owner, name, run_original, names_requests = _phases()[phase]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    records = Records()
    esp_logger = logging.getLogger("vllm.esp")
    esp_logger.addHandler(records)
    llm = make_llm(smollm2_dir, CONFIG, max_num_seqs=8,
                   per_request_spec_decode_metrics="detailed")
    try:
        # Strike a few calls in, then twice more (logged once).
        counts = inject_fault(monkeypatch, owner, name, calls=(4, 5, 9),
                              run_original=run_original)
        esp = generate(llm, prompts, params, label="esp")
        assert counts["raised"] >= 1, f"{owner.__name__}.{name} was not reached"
        monkeypatch.undo()
        again = generate(llm, prompts[:2], params, label="again")
    finally:
        esp_logger.removeHandler(records)
        shutdown(llm)
    assert esp.token_ids == plain.token_ids
    assert again.token_ids == plain.token_ids[:2]
    assert again.num_drafts > 0
    errors = [r for r in records.records
              if r.levelno >= logging.ERROR and f"ESP: {phase} failed" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in records.records]
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is InjectedFault
    assert "continue as plain decoding" in errors[0].getMessage()
    if names_requests:
        assert "requests - continue" not in errors[0].getMessage()


def test_a_kv_relocation_fault_keeps_only_each_blocks_first_token(
        smollm2_dir, prompts, plain, monkeypatch):
    """Where the KV relocation fails, the accepted nodes' K/V is not where
    the next steps read it: the runner must keep only each block's first
    token. An oracle puts the true next token among 4 siblings at a random
    position, so that accepted nodes need moving; the copy is skipped in
    every step from the second on. Outputs equal plain vLLM's only if the
    tokens after the first were dropped."""
    from vllm import SamplingParams

    from vllm_esp.runner import ESPModelRunnerMixin

    oracle = {"class": "vllm_esp_dev.oracle.OracleSource",
              "kwargs": {"continuations": [[p, o] for p, o in zip(prompts, plain.token_ids)],
                         "vocab_size": 49152, "seed": 1}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(smollm2_dir, {"method": "esp", "tree": [4], "candidates": ["esp"]},
                   max_num_seqs=8, additional_config={"esp_candidate_source": oracle})
    try:
        counts = inject_fault(monkeypatch, ESPModelRunnerMixin, "_relocate_kv",
                              calls=range(2, 10_000))
        esp = generate(llm, prompts, params, label="esp")
    finally:
        shutdown(llm)
    assert counts["raised"] >= 1
    assert esp.num_accepted > 0
    assert esp.token_ids == plain.token_ids
