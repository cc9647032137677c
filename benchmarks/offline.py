# SPDX-License-Identifier: Apache-2.0
"""Offline workload: ``LLM.generate`` over the prompt set, one engine per method.

The engine is built with ``max_num_seqs = max(batch_sizes)``. For each batch
size ``b`` (largest first is not required; the order given is kept):

* ``b == max``: one ``generate`` call with every prompt; vLLM batches them
  continuously, at most ``b`` at a time;
* ``b < max``: the prompts go in consecutive waves of ``b`` (one ``generate``
  call per wave: static batching); ``b == 1`` is one prompt at a time.

Methods with cross-request state (suffix decoding) get a fresh engine per
batch size, so every pass is a first pass over distinct prompts.

Timing is the sum of the ``generate`` calls' wall times (vllm_esp_dev.runs).
Each engine first generates a few tokens for a fixed warm-up prompt that is
not in the set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.methods import Method
from benchmarks.metrics import PassResult, Prompt, RequestRecord, counter_delta, row_count_delta


def engine_kwargs(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for vllm_esp_dev.runs.make_llm (besides model/config)."""
    kwargs = dict(options)
    if method.speculative_config is not None:
        # Puts spec_decode_metrics on every CompletionOutput (per-request tau).
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return kwargs


def _waves(prompts: list[Prompt], size: int) -> list[list[Prompt]]:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


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
                progress: Callable[[int], None] | None = None) -> list[PassResult]:
    from vllm_esp_dev.runs import generate, make_llm, shutdown, warm_up

    kwargs = engine_kwargs(method, llm_options)

    def new_engine(max_num_seqs: int):
        llm = make_llm(model, method.speculative_config,
                       max_num_seqs=max_num_seqs, **kwargs)
        warm_up(llm, warmup_ids)
        return llm

    results: list[PassResult] = []
    llm = None
    try:
        for batch_size in batch_sizes:
            startup = None
            if llm is None or method.cross_request_state:
                if llm is not None:
                    shutdown(llm)
                    llm = None
                started = time.perf_counter()
                llm = new_engine(batch_size if method.cross_request_state
                                 else max(batch_sizes))
                startup = time.perf_counter() - started
            engine_max = batch_size if method.cross_request_state else max(batch_sizes)
            groups = [prompts] if batch_size >= engine_max else _waves(prompts, batch_size)
            records: list[RequestRecord] = []
            counters: dict[str, float] = {}
            seconds = 0.0
            rows_before = esp_row_counts(llm)
            for group in groups:
                run = generate(llm, [p.token_ids for p in group], sampling_params,
                               label=method.name)
                seconds += run.seconds
                for name, value in run.counters.items():
                    counters[name] = counters.get(name, 0) + value
                metrics = run.spec_metrics or [None] * len(group)
                for prompt, token_ids, spec in zip(group, run.token_ids, metrics):
                    records.append(RequestRecord.from_spec_metrics(
                        prompt.index, prompt.category, token_ids, spec))
                if progress:
                    progress(len(group))
            notes = []
            if len(groups) > 1 and batch_size > 1:
                notes.append(f"static waves of {batch_size} prompts")
            if method.cross_request_state:
                notes.append("fresh engine for this pass (first pass over "
                             "distinct prompts; the cache holds only this "
                             "pass's earlier answers)")
            results.append(PassResult(method.name, "offline", batch_size, seconds,
                                      records, counter_delta({}, counters), notes,
                                      startup_seconds=startup,
                                      row_counts=row_count_delta(rows_before,
                                                                 esp_row_counts(llm))))
    finally:
        if llm is not None:
            shutdown(llm)
    return results
