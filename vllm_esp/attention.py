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
    kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[..., H, D]`` at physical ``blocks`` / in-block ``offsets``
    (any matching index shape) of a vec-layout cache."""
    key_cache, value_cache = split_vec_kv_cache(kv_cache)
    return key_cache[blocks, :, :, offsets], value_cache[blocks, :, offsets, :]


def prefix_gather_index(block_table: torch.Tensor, num_prefix: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    """Physical (block, offset) of positions ``0..p_b-1`` of each request,
    padded to the longest prefix: ``blocks``, ``offsets`` and ``valid``,
    each ``[B, max p]``. ``block_table`` rows belong to the B requests."""
    max_prefix = int(num_prefix.max()) if num_prefix.numel() else 0
    positions = torch.arange(max_prefix)
    valid = positions[None, :] < num_prefix[:, None]
    logical_blocks = (positions // block_size).expand(len(num_prefix), -1)
    blocks = torch.gather(block_table.long(), 1, logical_blocks)
    blocks = torch.where(valid, blocks, 0)
    offsets = (positions % block_size).expand_as(blocks)
    return blocks, offsets, valid


def tree_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked attention for a batch of blocks, with grouped KV heads.

    query ``[B, Q, Hq, D]``; keys/values ``[B, L, Hkv, D]`` (prefix then
    block); ``allowed [B, Q, L]`` (row may attend key). Returns
    ``[B, Q, Hq, D]``. Written out with matmuls rather than
    ``F.scaled_dot_product_attention``, whose masked CPU path was ~10x
    slower at these small shapes. Softmax runs in fp32.
    """
    batch, num_queries, num_heads, head_size = query.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    # [B, Hkv, G*Q, D]: queries of one KV head are contiguous.
    grouped = query.view(batch, num_queries, num_kv_heads, group, head_size)
    grouped = grouped.permute(0, 2, 3, 1, 4).reshape(
        batch, num_kv_heads, group * num_queries, head_size)
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)).float() * scale
    scores = scores.view(batch, num_kv_heads, group, num_queries, -1)
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    out = torch.matmul(probs.view(batch, num_kv_heads, group * num_queries, -1),
                       values.permute(0, 2, 1, 3))
    out = out.view(batch, num_kv_heads, group, num_queries, head_size)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, num_queries, num_heads,
                                              head_size)


def block_attention_mask(prefix_valid: torch.Tensor, tree_masks: torch.Tensor,
                         root_positions: torch.Tensor,
                         position_offsets: torch.Tensor,
                         sliding_window: int) -> torch.Tensor:
    """``[B, Q, P + Q]``: every real prefix position, then the tree mask; a
    sliding window keeps keys at ``t - window < s`` for a row at ``t``."""
    num_blocks, num_queries = position_offsets.shape
    allowed = torch.cat(
        [prefix_valid[:, None, :].expand(-1, num_queries, -1), tree_masks], dim=2)
    if sliding_window > 0:
        query_positions = root_positions[:, None] + position_offsets
        key_positions = torch.cat([
            torch.arange(prefix_valid.shape[1]).expand(num_blocks, -1),
            query_positions], dim=1)
        allowed &= (query_positions[:, :, None] - key_positions[:, None, :]
                    < sliding_window)
    return allowed


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
        # The stock kernel computes every row (causally); ESP rows are then
        # recomputed with their tree mask and overwritten.
        output = super().forward(layer, query, key, value, kv_cache,
                                 attn_metadata, output, output_scale,
                                 output_block_scale)
        step = current_step()
        if step is None or attn_metadata is None:
            return output
        step.kv_stash[layer.layer_name] = (key[step.node_rows],
                                           value[step.node_rows])
        prefix_blocks, prefix_offsets, allowed = self._step_tensors(
            step, attn_metadata, kv_cache)
        prefix_keys, prefix_values = gather_cached_kv(
            kv_cache, prefix_blocks, prefix_offsets)
        rows = step.query_rows
        keys = torch.cat([prefix_keys, key[rows]], dim=1)
        values = torch.cat([prefix_values, value[rows]], dim=1)
        attended = tree_attention(query[rows], keys, values, allowed, self.scale)
        valid = step.query_valid
        output_rows = output.view(output.shape[0], -1)
        output_rows[rows[valid]] = attended[valid].reshape(
            -1, output_rows.shape[1]).to(output.dtype)
        return output

    def _step_tensors(self, step, attn_metadata, kv_cache):
        """Gather indices and masks are the same for every layer sharing a
        block table and window: compute them once per step."""
        cache_key = (id(attn_metadata.block_table), self.sliding_window)
        cached = step.attention_cache.get(cache_key)
        if cached is None:
            batch_indices = torch.tensor([b.batch_index for b in step.blocks])
            prefix_blocks, prefix_offsets, prefix_valid = prefix_gather_index(
                attn_metadata.block_table[batch_indices], step.root_positions,
                block_size=kv_cache.shape[2])
            allowed = block_attention_mask(
                prefix_valid, step.tree_masks, step.root_positions,
                step.position_offsets, self.sliding_window)
            cached = (prefix_blocks, prefix_offsets, allowed)
            step.attention_cache[cache_key] = cached
        return cached


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
    read_keys, read_values = gather_cached_kv(
        kv_cache, block_table_row[positions // block_size].long(),
        positions % block_size)
    if not (torch.equal(read_keys, keys) and torch.equal(read_values, values)):
        raise RuntimeError(
            "vllm-esp: the CPU KV-cache 'vec' layout of this vLLM differs from "
            "the one ESP tree attention reads; this vLLM version is not "
            "supported by vllm-esp.")
