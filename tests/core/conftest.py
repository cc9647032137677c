# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the ESP core tests."""

from __future__ import annotations

import pytest
import torch
from tiny_models import get_model


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core
    machine OpenMP's spinning workers can make a 1 ms forward take 200 ms."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def llama():
    return get_model("llama-sdpa")


@pytest.fixture(scope="session")
def gemma3():
    return get_model("gemma3-sdpa")
