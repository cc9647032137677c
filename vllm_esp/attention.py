"""Tree attention for ESP blocks on vLLM's CPU attention backend.

vLLM's C++ CPU kernel (``cpu_attention_with_kv_cache``) supports causal or
non-causal attention only; it takes no mask. ESP needs, inside each block,
the tree mask of :class:`vllm_esp.core.tree.BlockLayout`. This backend runs
the stock kernel for the whole batch, then recomputes the rows of ESP blocks
in torch: each block attends to its request's whole cached prefix plus the
block rows its tree mask allows.

It is registered over ``CPU_ATTN`` by the ESP worker only (vLLM's CPU
platform always picks ``CPU_ATTN``), so runs without ESP never see it.

Reading the prefix from the paged cache needs the ``vec`` layout, in which
(per block and KV head) K is stored column-major ``[head_size, block_size]``
and V row-major ``[block_size, head_size]``. fp32 models use it anyway; for
bf16 on AMX machines the builder forces ``vec`` instead of the AMX-packed
layout. :func:`check_vec_layout` verifies the layout at start-up.

Only checked on CPU (vLLM 0.32.0). GPU backends need their own tree mask
(e.g. Triton's ``qq_bias``) and are not implemented yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_esp.step import current_step

TREE_ATTN_LAYOUT = "vec"


def split_vec_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(key [nb, H, D, bs], value [nb, H, bs, D])`` of a vec-layout
    cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    num_blocks, num_kv_heads, block_size, two_head = kv_cache.shape
    head_size = two_head // 2
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size)
    key_cache, value_cache = halves.chunk(2, dim=2)
    key_cache = key_cache.reshape(num_blocks, num_kv_heads, head_size, block_size)
    return key_cache, value_cache


def gather_cached_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_tokens, H, D]`` of positions ``0..num_tokens-1``."""
    key_cache, value_cache = split_vec_kv_cache(kv_cache)
    block_size = value_cache.shape[2]
    positions = torch.arange(num_tokens, device=kv_cache.device)
    blocks = block_table_row[positions // block_size].long()
    offsets = positions % block_size
    keys = key_cache[blocks, :, :, offsets]
    values = value_cache[blocks, :, offsets, :]
    return keys, values


def tree_attention(
    query: torch.Tensor,
    block_keys: torch.Tensor,
    block_values: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None = None,
    sliding_window: int = -1,
) -> torch.Tensor:
    """Attention of one block's rows over its prefix and the allowed block rows.

    query ``[Q, Hq, D]``; block keys/values ``[Q, Hkv, D]``; prefix keys/values
    ``[p, Hkv, D]``; ``tree_mask [Q, Q]`` (row may attend column). With a
    sliding window, a row at position ``t`` sees keys at ``t - window < s``.
    Returns ``[Q, Hq, D]``.
    """
    num_prefix = prefix_keys.shape[0]
    keys = torch.cat([prefix_keys, block_keys], dim=0).transpose(0, 1)
    values = torch.cat([prefix_values, block_values], dim=0).transpose(0, 1)
    allowed = torch.cat(
        [tree_mask.new_ones(tree_mask.shape[0], num_prefix), tree_mask], dim=1)
    if sliding_window > 0:
        assert query_positions is not None
        key_positions = torch.cat([
            torch.arange(num_prefix, device=query.device), query_positions])
        allowed = allowed & (
            query_positions[:, None] - key_positions[None, :] < sliding_window)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys, values, attn_mask=allowed, scale=scale,
        enable_gqa=True)
    return out.transpose(0, 1)


class ESPCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in ("vec", "vec16"):
            # Tree rows read the cache from torch, which needs an unpacked
            # layout; the AMX layout is prepacked for tiles.
            self.isa = TREE_ATTN_LAYOUT
            self._set_isa_to_layers(layer_names)


class ESPCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = []
        if self.alibi_slopes is not None:
            unsupported.append("ALiBi")
        if self.logits_soft_cap:
            unsupported.append("logits soft-capping")
        if self.sinks is not None:
            unsupported.append("attention sinks")
        if unsupported:
            raise ValueError(
                "ESP tree attention on CPU does not support "
                f"{', '.join(unsupported)}; this model cannot use "
                "speculative_config method 'esp'.")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata,
                output, output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache,
                                 attn_metadata, output, output_scale,
                                 output_block_scale)
        step = current_step()
        if step is None or attn_metadata is None:
            return output
        step.kv_stash[layer.layer_name] = (key[step.node_rows].clone(),
                                           value[step.node_rows].clone())
        for block in step.blocks:
            layout = block.layout
            rows = slice(block.row_start, block.row_start + layout.block_size)
            prefix_keys, prefix_values = gather_cached_kv(
                kv_cache, attn_metadata.block_table[block.batch_index],
                block.root_position)
            attended = tree_attention(
                query[rows], key[rows], value[rows], prefix_keys,
                prefix_values, layout.attention_mask, self.scale,
                query_positions=block.root_position + layout.position_offsets,
                sliding_window=self.sliding_window)
            output[rows] = attended.reshape(output[rows].shape).to(output.dtype)
        return output


class ESPCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return ESPCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ESPCPUAttentionMetadataBuilder


def check_vec_layout(dtype: torch.dtype = torch.float32) -> None:
    """Round-trip K/V through vLLM's cache writer and our reader.

    Raises if the installed vLLM stores the vec layout differently than
    :func:`gather_cached_kv` assumes, so a layout change fails loudly at
    start-up instead of producing wrong tree attention.
    """
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, block_size, head_size = 3, 2, 32, 32
    kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size,
                           dtype=dtype)
    num_tokens = 2 * block_size + 5
    keys = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    block_table_row = torch.tensor([2, 0, 1], dtype=torch.int32)
    positions = torch.arange(num_tokens)
    slots = block_table_row[positions // block_size].long() * block_size \
        + positions % block_size
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size)
    key_cache, value_cache = halves.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots,
                                   TREE_ATTN_LAYOUT, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    read_keys, read_values = gather_cached_kv(kv_cache, block_table_row, num_tokens)
    if not (torch.equal(read_keys, keys) and torch.equal(read_values, values)):
        raise RuntimeError(
            "vllm-esp: the CPU KV-cache 'vec' layout of this vLLM differs from "
            "the one ESP tree attention reads; this vLLM version is not "
            "supported by vllm-esp.")
