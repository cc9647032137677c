"""ESP under tensor parallelism (TP=2) on vLLM's multiprocessing executor.

Every rank builds the same trees from the all-gathered logits, embeds the
mask vectors with the same collective calls, and relocates the KV of its own
heads. Greedy ESP at TP=2 must therefore give exactly TP=1's plain output,
with the same spec-decode counters as ESP at TP=1.

Two CPU workers need one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``
(without it vLLM stops with "Not enough allowed NUMA nodes to bind threads
of 2 local CPUWorkers"). Slow (four engines, two of them with two workers):

    ./run python -m pytest tests/test_tensor_parallel.py -m slow
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_esp.runs import run_once

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_PROMPTS = 8
NEW_TOKENS = 48


@pytest.fixture
def two_cpu_workers(monkeypatch):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on CPU needs two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def _tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (int(8 + 5 * i),), generator=generator).tolist()
            for i in range(NUM_PROMPTS)]


def _check_tp2_matches_tp1(model, prompts, speculative_config, **llm_kwargs):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain_tp1 = run_once(model, prompts, params, label="plain tp1", **llm_kwargs)
    esp_tp1 = run_once(model, prompts, params, speculative_config=speculative_config,
                       label="esp tp1", **llm_kwargs)
    esp_tp2 = run_once(model, prompts, params, speculative_config=speculative_config,
                       tensor_parallel_size=2, distributed_executor_backend="mp",
                       label="esp tp2", **llm_kwargs)
    assert esp_tp1.token_ids == plain_tp1.token_ids
    mismatched = [i for i, (a, b) in enumerate(zip(plain_tp1.token_ids, esp_tp2.token_ids))
                  if a != b]
    assert not mismatched, f"TP=2 ESP differs from TP=1 plain on prompts {mismatched}"
    assert esp_tp2.num_drafts > 0 and esp_tp2.num_accepted > 0
    assert esp_tp2.counters == esp_tp1.counters
    return esp_tp2


@pytest.mark.parametrize("speculative_config", [
    {"method": "esp"},
    {"method": "esp", "block_complexity": 12, "num_mask_tokens": 2, "candidates": ["esp"]},
], ids=["default", "esp-bc12-k2"])
def test_tp2_tiny_llama(tiny_llama_dir, two_cpu_workers, speculative_config):
    # 4 query heads and 2 KV heads: each rank holds 2 and 1.
    _check_tp2_matches_tp1(tiny_llama_dir, _tiny_prompts(), speculative_config,
                           skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8)


def test_tp2_gemma3(two_cpu_workers, spec_bench):
    """Gemma-3-270M: 4 query heads and a single KV head, which TP=2
    replicates on both ranks; sliding-window layers; scaled embeddings."""
    from transformers import AutoTokenizer

    from vllm_esp.data import chat_prompt_ids, select_questions
    from vllm_esp.models import model_path

    model = str(model_path("gemma3-270m"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = select_questions(spec_bench, per_category=1, limit=NUM_PROMPTS)
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    _check_tp2_matches_tp1(model, prompts, {"method": "esp"},
                           max_model_len=2048, max_num_seqs=8)
