# SPDX-License-Identifier: Apache-2.0
"""``ESPModelRunnerMixin._preprocess``: a step takes vLLM's input-embeddings
path only when a block has mask rows or a request sent prompt embeddings;
any other step takes the token-id path, and the runner's switch is back on
afterwards, also when vLLM's preprocessing raises (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_esp.runner import ESPModelRunnerMixin


class VLLMRunner:
    """Stands for vLLM's runner: records which input path it was asked for."""

    fail = False

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        self.paths.append("embeddings" if self.enable_prompt_embeds else "token ids")
        if self.fail:
            raise RuntimeError("vLLM's preprocessing failed")
        return "inputs"


class Runner(ESPModelRunnerMixin, VLLMRunner):
    def __init__(self, step=None, prompt_embeds=None) -> None:
        self._esp_step = step
        self.input_batch = SimpleNamespace(req_prompt_embeds=prompt_embeds or {})
        self.enable_prompt_embeds = True
        self.paths: list[str] = []


def test_steps_without_mask_rows_take_the_token_id_path():
    for step in (None, SimpleNamespace(has_mask_rows=False)):
        runner = Runner(step)
        assert runner._preprocess(None, 8) == "inputs"
        assert runner.paths == ["token ids"]
        assert runner.enable_prompt_embeds


def test_mask_rows_and_prompt_embeds_take_the_embeddings_path():
    assert_paths = [(Runner(SimpleNamespace(has_mask_rows=True)), "embeddings"),
                    (Runner(None, prompt_embeds={0: object()}), "embeddings")]
    for runner, path in assert_paths:
        runner._preprocess(None, 8)
        assert runner.paths == [path]
        assert runner.enable_prompt_embeds


def test_the_switch_is_restored_when_preprocessing_raises():
    runner = Runner()
    runner.fail = True
    with pytest.raises(RuntimeError):
        runner._preprocess(None, 8)
    assert runner.paths == ["token ids"]
    assert runner.enable_prompt_embeds
