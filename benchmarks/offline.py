# SPDX-License-Identifier: Apache-2.0
"""Offline workload: ``LLM.generate`` over the prompt set, one engine per
method and batch size.

Every batch size ``b`` gets a fresh engine with ``max_num_seqs = b`` and one
``generate`` call with every prompt, which vLLM batches continuously, at most
``b`` at a time (``b == 1`` is one prompt at a time). Every method thus runs
each level in the same regime. (Until 2026-12-02 only methods with
cross-request state got this; the others ran smaller batch sizes as static
waves on one engine, which made them look slower than ``suffix`` there.)
A fresh engine also makes every pass of suffix decoding a first pass over
distinct prompts.

Timing is the ``generate`` call's wall time (vllm_esp_dev.runs).
Each engine first generates a few tokens for a fixed warm-up prompt that is
not in the set (greedily, and for a sampled pass once more with its
sampling, so that the sampled path's first calls are not timed either).
``sampling_params`` is one ``SamplingParams`` for every prompt or a list of
one per prompt (a sampled pass's per-request seeds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.methods import Method
from benchmarks.metrics import PassResult, Prompt, RequestRecord, row_count_delta


def engine_kwargs(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for vllm_esp_dev.runs.make_llm (besides model/config)."""
    kwargs = dict(options)
    if method.speculative_config is not None:
        # Puts spec_decode_metrics on every CompletionOutput (per-request tau).
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return kwargs


def esp_row_counts(llm) -> dict[str, int] | None:
    """The ESP worker's cumulative decode request-steps and rows (rank 0);
    None for other methods."""
    additional = llm.llm_engine.vllm_config.additional_config or {}
    if "esp" not in additional:
        return None
    return llm.collective_rpc("esp_row_counts")[0]


def run_offline(method: Method, model: str, prompts: list[Prompt],
                batch_sizes: list[int], sampling_params, warmup_ids: list[int],
                llm_options: dict[str, Any],
                progress: Callable[[int], None] | None = None,
                temperature: float = 0.0, warmup_params=None) -> list[PassResult]:
    from vllm_esp_dev.runs import generate, make_llm, shutdown, warm_up

    kwargs = engine_kwargs(method, llm_options)

    def new_engine(max_num_seqs: int):
        llm = make_llm(model, method.speculative_config,
                       max_num_seqs=max_num_seqs, **kwargs)
        warm_up(llm, warmup_ids)
        if warmup_params is not None:
            generate(llm, [warmup_ids], warmup_params)
        return llm

    results: list[PassResult] = []
    for batch_size in batch_sizes:
        started = time.perf_counter()
        llm = new_engine(batch_size)
        try:
            startup = time.perf_counter() - started
            rows_before = esp_row_counts(llm)
            run = generate(llm, [p.token_ids for p in prompts], sampling_params,
                           label=method.name)
            metrics = run.spec_metrics or [None] * len(prompts)
            emitting_steps = run.emitting_steps or [None] * len(prompts)
            records = [RequestRecord.from_spec_metrics(prompt.index, prompt.category,
                                                       token_ids, spec)
                       .with_emitting_steps(steps, exact=steps is not None)
                       for prompt, token_ids, spec, steps in zip(
                           prompts, run.token_ids, metrics, emitting_steps, strict=True)]
            if progress:
                progress(len(prompts))
            notes = []
            if method.cross_request_state:
                notes.append("the cache holds only this pass's earlier answers")
            results.append(PassResult(method.name, "offline", batch_size, run.seconds,
                                      records, dict(run.counters), notes,
                                      startup_seconds=startup,
                                      row_counts=row_count_delta(rows_before,
                                                                 esp_row_counts(llm)),
                                      temperature=temperature))
        finally:
            shutdown(llm)
    return results
