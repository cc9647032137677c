# SPDX-License-Identifier: Apache-2.0
"""Tiny random transformers models for the ESP core tests (built once per session)."""

from __future__ import annotations

import torch

VOCAB_SIZE = 256


def tiny_llama(attn_implementation: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    model.set_attn_implementation(attn_implementation)
    return model


def tiny_gemma3(attn_implementation: str = "sdpa", seed: int = 0):
    """Gemma 3 with a 6-token sliding window on layer 0: exercises the
    per-layer-type masks and the embedding scale (sqrt(64) = 8)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512)
    model = Gemma3ForCausalLM(config).float().eval()
    model.set_attn_implementation(attn_implementation)
    return model


MODEL_FACTORIES = {
    "llama-sdpa": lambda: tiny_llama("sdpa"),
    "llama-eager": lambda: tiny_llama("eager"),
    "gemma3-sdpa": lambda: tiny_gemma3("sdpa"),
    "gemma3-eager": lambda: tiny_gemma3("eager"),
}

_cache: dict[str, torch.nn.Module] = {}


def get_model(name: str) -> torch.nn.Module:
    if name not in _cache:
        _cache[name] = MODEL_FACTORIES[name]()
    return _cache[name]
