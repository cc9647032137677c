# SPDX-License-Identifier: Apache-2.0
"""What the ESP worker checks before it serves: every attention layer got
ESP's tree attention, and its backend leaves the KV-cache write to vLLM's
separate update op (the slot mappings that ESP's KV relocation reads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_esp.attention import ESPCPUAttentionBackend
from vllm_esp.worker import check_tree_attention_in_use


def groups(*backends):
    return [[SimpleNamespace(backend=backend) for backend in backends]]


def test_esp_backend_passes():
    assert ESPCPUAttentionBackend.forward_includes_kv_cache_update is False
    check_tree_attention_in_use(groups(ESPCPUAttentionBackend, ESPCPUAttentionBackend))


def test_a_layer_with_vllms_own_backend_is_refused():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    with pytest.raises(RuntimeError, match="CPUAttentionBackend, not ESP's tree attention"):
        check_tree_attention_in_use(groups(ESPCPUAttentionBackend, CPUAttentionBackend))


def test_a_backend_that_writes_the_cache_in_its_forward_is_refused():
    class FusedUpdateBackend(ESPCPUAttentionBackend):
        forward_includes_kv_cache_update = True

    with pytest.raises(RuntimeError, match="FusedUpdateBackend writes the KV cache"):
        check_tree_attention_in_use(groups(ESPCPUAttentionBackend, FusedUpdateBackend))
