# SPDX-License-Identifier: Apache-2.0
"""Test fixtures: tiny seeded random models that vLLM and transformers load fast.

``make_tiny_llama(path)`` writes a 2-layer ``LlamaForCausalLM`` with a 512
token vocabulary (about 0.2M parameters) to ``path``. It is deterministic for
a given ``seed``, so tests can compare exact greedy tokens between the vLLM
path and a reference decoder without any download.

vLLM can load it with ``skip_tokenizer_init=True`` (give prompts as token
ids and set ``SamplingParams(detokenize=False)``), or normally when
``with_tokenizer=True``: then a byte-level tokenizer is written too,
padded with placeholder tokens so that every model id decodes.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
_SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]
_NUM_BYTES = 256


def make_tiny_llama(
    path: str | Path,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.2,
    dtype: str = "float32",
    with_tokenizer: bool = False,
) -> Path:
    """Write a seeded random Llama model (config.json + model.safetensors) to ``path``.

    ``head_dim`` defaults to 32 rather than hidden_size/num_heads = 16 because
    vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
    ``initializer_range`` is ten times the Llama default: with 0.02 a tiny
    random model gives almost flat logits, and near-ties make greedy argmax
    flip on float rounding differences between implementations; 0.2 gives
    well separated logits (still finite: norms keep activations in range).
    Returns the path.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if with_tokenizer and vocab_size < len(_SPECIAL_TOKENS) + _NUM_BYTES:
        raise ValueError(f"vocab_size must be >= {len(_SPECIAL_TOKENS) + _NUM_BYTES} with a tokenizer")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    torch_dtype = getattr(torch, dtype)
    # Seed right before construction: __init__ draws all random weights.
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch_dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    # No sampling defaults: vLLM would otherwise pick them up from here.
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(path)
    if with_tokenizer:
        write_byte_tokenizer(path, vocab_size)
    return path


def write_byte_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A byte-level tokenizer: 3 specials, 256 byte tokens, then placeholders.

    No merges, so every byte is one token (ids 3..258). Placeholders
    ``<|extra_N|>`` fill the vocabulary up to ``vocab_size`` so that any id a
    random model emits has a spelling when vLLM detokenizes it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda ch: _byte_of_char(ch))
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(_SPECIAL_TOKENS)
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - len(vocab))])
    tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1 << 30,
    )
    fast.save_pretrained(path)
    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["add_bos_token"] = True
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _byte_of_char(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
