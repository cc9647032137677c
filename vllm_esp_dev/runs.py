# SPDX-License-Identifier: Apache-2.0
"""Small helpers to run vLLM with and without ESP side by side.

Used by the demo, the tests and the benchmarks, so that all of them build
engines the same way and read vLLM's spec-decode counters the same way.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

# vLLM's CPU backend reserves most of RAM for the KV cache when this is
# unset; 2 GiB is plenty for the bundled small models. Set before vLLM loads.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@dataclass
class GenerationRun:
    label: str
    token_ids: list[list[int]]
    texts: list[str]
    seconds: float
    counters: dict[str, float] = field(default_factory=dict)
    # Per request: vLLM's RequestSpecDecodeMetrics.to_dict(), or None. Only
    # filled when the engine runs with per_request_spec_decode_metrics.
    spec_metrics: list[dict | None] = field(default_factory=list)
    # Per request: engine steps whose output carried tokens for it, the
    # prefill's included (its target forwards), counted as the front end
    # receives them; see ``count_emitting_steps``.
    emitting_steps: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0

    @property
    def num_drafts(self) -> int:
        return int(self.counters.get("vllm:spec_decode_num_drafts", 0))

    @property
    def num_accepted(self) -> int:
        return int(self.counters.get("vllm:spec_decode_num_accepted_tokens", 0))

    @property
    def tau(self) -> float | None:
        """Mean tokens emitted per verification step (vLLM's mean acceptance
        length): 1 + accepted / drafts."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted / self.num_drafts


def spec_counters(llm) -> dict[str, float]:
    values = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            values[metric.name] = metric.value
    return values


def make_llm(model: str, speculative_config: dict | None = None, *,
             dtype: str = "float32", max_model_len: int | None = 2048,
             max_num_seqs: int = 16, seed: int = 0, enforce_eager: bool = True,
             **kwargs: Any):
    """An engine with settings that fit this project's 2-core CPU boxes.

    Eager by default: torch.compile makes an engine start take ~130 s instead
    of ~25 s on 2 cores, which dominates tests and short runs. Pass
    ``enforce_eager=False`` to measure compiled steady-state speed.
    """
    from vllm import LLM

    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return LLM(model=str(model), dtype=dtype,
               max_num_seqs=max_num_seqs, seed=seed,
               speculative_config=speculative_config, enforce_eager=enforce_eager,
               disable_log_stats=False, **kwargs)


def generate(llm, prompts_token_ids: list[list[int]], sampling_params,
             label: str = "", progress: bool | Any = False) -> GenerationRun:
    """``progress``: vLLM's progress bars (``use_tqdm``: a bool, or a
    function making a tqdm bar)."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompts_token_ids]
    before = spec_counters(llm)
    with count_emitting_steps(llm) as steps_by_request:
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling_params, use_tqdm=progress)
        seconds = time.perf_counter() - start
    after = spec_counters(llm)
    counters = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    return GenerationRun(
        label=label,
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        texts=[o.outputs[0].text or "" for o in outputs],
        seconds=seconds,
        counters=counters,
        spec_metrics=[_request_spec_metrics(o) for o in outputs],
        emitting_steps=[steps_by_request.get(o.request_id, 0) for o in outputs],
    )


@contextlib.contextmanager
def count_emitting_steps(llm):
    """Count, per request id, the engine steps whose output carries tokens
    for the request: its target forwards, exactly, for any method. vLLM's
    spec-decode metrics cannot give this: they count accepted drafts that
    ``max_tokens`` or a stop token then cuts, and skip steps without drafts.
    Wraps the front end's ``OutputProcessor.process_outputs`` for the
    duration (one engine step's outputs per call, in offline ``LLM`` use)."""
    processor = llm.llm_engine.output_processor
    original = processor.process_outputs
    counts: dict[str, int] = {}

    def process_outputs(engine_core_outputs, *args, **kwargs):
        for output in engine_core_outputs:
            if output.new_token_ids:
                state = processor.request_states.get(output.request_id)
                request_id = state.external_req_id if state is not None else output.request_id
                counts[request_id] = counts.get(request_id, 0) + 1
        return original(engine_core_outputs, *args, **kwargs)

    processor.process_outputs = process_outputs
    try:
        yield counts
    finally:
        del processor.process_outputs


def _request_spec_metrics(output) -> dict | None:
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    return metrics.to_dict() if metrics is not None else None


def warm_up(llm, prompt_ids: list[int]) -> None:
    """Decode ``prompt_ids`` for 8 tokens, untimed: one-time costs (first
    kernel calls, allocator growth) stay out of the timed runs."""
    from vllm import SamplingParams

    generate(llm, [prompt_ids], SamplingParams(temperature=0.0, max_tokens=8))


def run_once(model: str, prompts_token_ids, sampling_params,
             speculative_config: dict | None = None, label: str = "",
             progress: bool | Any = False, warmup_ids: list[int] | None = None,
             **llm_kwargs) -> GenerationRun:
    """Build an engine, generate, shut it down; with ``warmup_ids``, first
    ``warm_up`` on them (as the benchmarks warm up every engine)."""
    llm = make_llm(model, speculative_config, **llm_kwargs)
    try:
        if warmup_ids is not None:
            warm_up(llm, warmup_ids)
        return generate(llm, prompts_token_ids, sampling_params, label=label,
                        progress=progress)
    finally:
        shutdown(llm)


def shutdown(llm) -> None:
    import gc

    engine = getattr(llm, "llm_engine", None)
    try:
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
