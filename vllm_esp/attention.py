# SPDX-License-Identifier: Apache-2.0
"""Tree attention for ESP blocks on vLLM's CPU attention backend.

vLLM's C++ CPU kernel (``cpu_attention_with_kv_cache``) supports causal or
non-causal attention only: it takes no mask and returns no log-sum-exp.
ESP needs, inside each verification block, the tree mask of
:class:`vllm_esp.core.tree.BlockLayout`. So, for a step that holds ESP
blocks, this backend splits the batch:

* the ESP blocks go to ``torch.ops.vllm_esp.tree_attention``
  (``vllm_esp/csrc/tree_attention.cpp``), which attends each block row to
  its request's committed prefix, read in place from the paged cache, and to
  the block rows its tree mask allows, in one online-softmax pass;
* so do the plain decodes beside them, as 1-row blocks. Under ``auto``
  block sizes most steps mix a few blocks with many plain decodes; a second
  kernel per layer for them (with its gathers and scheduler metadata) cost
  about a tenth of a plain step at batch 8 (docs/results.md, "One attention
  kernel per step");
* the other requests (prefill chunks, chain fallbacks) go to vLLM's kernel
  as a sub-batch of their own.

Every row is computed once, and nothing is copied out of the cache. Steps
without ESP blocks run vLLM's forward unchanged. The metadata of both parts
is built once per step (per KV-cache group) by the builder, not per layer.

The kernel reads the cache in the ``vec`` layout, in which (per block and
KV head) K is stored column-major ``[head_size, block_size]`` and V
row-major ``[block_size, head_size]``. fp32 models use it anyway; for bf16
on AMX machines the builder forces ``vec`` instead of the AMX-packed layout.
:func:`check_vec_layout` verifies the layout at start-up.

Registered over ``CPU_ATTN`` by the ESP worker only (vLLM's CPU platform
always picks ``CPU_ATTN``), so runs without ESP never see it. Only checked
on CPU (vLLM 0.32.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_esp.profiling import scope
from vllm_esp.step import ESPStep

TREE_ATTN_LAYOUT = "vec"


@dataclass
class TreeAttentionMetadata:
    """The ESP blocks of one step, for one KV-cache group (int32, CPU)."""

    block_tables: torch.Tensor      # [B, max_blocks] the blocks' requests' rows
    row_starts: torch.Tensor        # [B] flat row of each block's root
    num_rows: torch.Tensor          # [B] Q of each block
    prefix_lens: torch.Tensor       # [B] committed tokens before the root
    tree_masks: torch.Tensor        # [B, Qmax, Qmax] bool, row may attend row
    position_offsets: torch.Tensor  # [B, Qmax] tree position minus root's


@dataclass
class ESPCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's metadata for the whole batch, plus the split of a step that
    holds ESP blocks: ``tree`` for the blocks, ``plain`` (vLLM's own
    metadata) for the other requests, whose flat rows are ``plain_rows``."""

    tree: TreeAttentionMetadata | None = None
    plain: CPUAttentionMetadata | None = None
    plain_rows: torch.Tensor | None = None


class ESPCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    # The blocks of the step being built, set by the runner that owns this
    # builder (ESPModelRunnerMixin._esp_publish_step); None: no blocks.
    esp_step: ESPStep | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in ("vec", "vec16"):
            # The tree kernel reads the cache in the unpacked vec layout; the
            # AMX layout is prepacked for tiles.
            self.isa = TREE_ATTN_LAYOUT
            self._set_isa_to_layers(layer_names)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        step = self.esp_step
        if step is None or metadata.causal is not True or metadata.dynamic_causal is not None:
            return metadata
        with scope("esp: attention metadata"):
            try:
                return self._split(metadata, step, common_attn_metadata)
            except Exception as error:
                # Plain causal attention for the whole batch: each block's
                # root row still gets its true logits, and the runner emits
                # only those and reports the error (ESPModelRunnerMixin._sample).
                step.failure = error
                return metadata

    def _split(self, metadata: CPUAttentionMetadata, step,
               common) -> ESPCPUAttentionMetadata:
        num_reqs = common.num_reqs
        seq_lens = metadata.seq_lens
        query_start_loc = metadata.query_start_loc
        if step.batch_indices.shape[0] == num_reqs:
            # Every request is a block (batch indices 0..n-1): nothing to
            # split, and a handful of tensor ops instead of a few dozen.
            tree = TreeAttentionMetadata(
                block_tables=metadata.block_table[:num_reqs],
                row_starts=query_start_loc[:num_reqs],
                num_rows=step.num_rows,
                prefix_lens=(seq_lens[:num_reqs] - step.num_rows).to(torch.int32),
                tree_masks=step.tree_masks,
                position_offsets=step.position_offsets)
            return ESPCPUAttentionMetadata(
                **{name: getattr(metadata, name) for name in metadata.__dataclass_fields__},
                tree=tree)
        # The split's bookkeeping in numpy over the CPU tensors' memory: a
        # few dozen small torch ops here cost more than the rest of the
        # builder.
        starts = query_start_loc.numpy()
        query_lens = starts[1:num_reqs + 1] - starts[:num_reqs]
        is_block = np.zeros(num_reqs, np.bool_)
        blocks = np.asarray(step.batch_indices)  # ascending
        is_block[blocks] = True
        # One-row queries (plain decodes beside the blocks) are 1-row blocks
        # to the tree kernel: a step then runs one attention kernel per
        # layer, not two, and gathers nothing for vLLM's.
        is_decode = ~is_block & (query_lens == 1)
        decodes = np.flatnonzero(is_decode)
        tree_requests = np.concatenate([blocks, decodes])
        num_blocks, num_trees = blocks.shape[0], tree_requests.shape[0]
        block_masks = step.tree_masks.numpy()
        block_offsets = step.position_offsets.numpy()
        max_rows = block_masks.shape[1]
        tree_masks = np.zeros((num_trees, max_rows, max_rows), np.bool_)
        tree_masks[:num_blocks] = block_masks
        tree_masks[num_blocks:, 0, 0] = True
        position_offsets = np.zeros((num_trees, max_rows), block_offsets.dtype)
        position_offsets[:num_blocks] = block_offsets
        num_rows = np.ones(num_trees, np.int32)
        num_rows[:num_blocks] = step.num_rows.numpy()
        tree = TreeAttentionMetadata(
            block_tables=metadata.block_table[torch.from_numpy(tree_requests)],
            row_starts=torch.from_numpy(starts[tree_requests]),
            num_rows=torch.from_numpy(num_rows),
            prefix_lens=torch.from_numpy(
                (seq_lens.numpy()[tree_requests] - num_rows).astype(np.int32)),
            tree_masks=torch.from_numpy(tree_masks),
            position_offsets=torch.from_numpy(position_offsets),
        )
        plain = plain_rows = None
        plain_requests = torch.from_numpy(np.flatnonzero(~(is_block | is_decode)))
        if plain_requests.numel():
            query_lens = torch.from_numpy(query_lens)[plain_requests]
            plain_query_start = torch.zeros(plain_requests.numel() + 1, dtype=torch.int32)
            torch.cumsum(query_lens, 0, out=plain_query_start[1:])
            plain_rows = torch.repeat_interleave(
                query_start_loc[plain_requests].long()
                - plain_query_start[:-1].long(), query_lens.long()) + torch.arange(
                    int(plain_query_start[-1]))
            plain_seq_lens = seq_lens[plain_requests]
            plain = CPUAttentionMetadata(
                num_actual_tokens=int(plain_query_start[-1]),
                max_query_len=int(query_lens.max()),
                query_start_loc=plain_query_start,
                max_seq_len=int(plain_seq_lens.max()),
                seq_lens=plain_seq_lens,
                block_table=metadata.block_table[plain_requests],
                slot_mapping=metadata.slot_mapping[plain_rows],
                scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=plain_requests.numel(), num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    seq_lens=plain_seq_lens, dtype=self.dtype,
                    query_start_loc=plain_query_start, causal=True,
                    sliding_window_size=self.window_size, isa=self.isa,
                    enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                    kv_cache_dtype=self.kv_cache_dtype),
                causal=True,
            )
        return ESPCPUAttentionMetadata(
            **{name: getattr(metadata, name) for name in metadata.__dataclass_fields__},
            tree=tree, plain=plain, plain_rows=plain_rows)


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
        if self.is_fp8_kv_cache:
            unsupported.append(f"kv_cache_dtype={self.kv_cache_dtype!r}")
        if unsupported:
            raise ValueError(
                "ESP tree attention on CPU does not support "
                f"{', '.join(unsupported)}; this model or setting cannot use "
                "speculative_config method 'esp'.")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata,
                output, output_scale=None, output_block_scale=None):
        tree = getattr(attn_metadata, "tree", None)
        if tree is None:
            return super().forward(layer, query, key, value, kv_cache,
                                   attn_metadata, output, output_scale,
                                   output_block_scale)
        with scope("esp: tree attention"):
            if attn_metadata.plain is not None:
                rows = attn_metadata.plain_rows
                plain_output = output.new_empty((rows.numel(),) + output.shape[1:])
                super().forward(layer, query[rows], key[rows], value[rows], kv_cache,
                                attn_metadata.plain, plain_output)
                output[rows] = plain_output
            torch.ops.vllm_esp.tree_attention(
                output.view(output.shape[0], self.num_heads, self.head_size),
                query, key, value, kv_cache, tree.block_tables, tree.row_starts,
                tree.num_rows, tree.prefix_lens, tree.tree_masks,
                tree.position_offsets, self.scale, self.sliding_window)
        return output


class ESPCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return ESPCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ESPCPUAttentionMetadataBuilder


def split_vec_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(key [nb, H, D, bs], value [nb, H, bs, D])`` of a vec-layout
    cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    num_blocks, num_kv_heads, block_size, two_head = kv_cache.shape
    head_size = two_head // 2
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size)
    key_cache, value_cache = halves.chunk(2, dim=2)
    key_cache = key_cache.reshape(num_blocks, num_kv_heads, head_size, block_size)
    return key_cache, value_cache


def write_vec_kv_cache(kv_cache: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM's own cache writer (``cpu_attn_reshape_and_cache``), vec layout."""
    num_blocks, num_kv_heads, block_size, two_head = kv_cache.shape
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, two_head // 2)
    key_cache, value_cache = halves.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots,
                                   TREE_ATTN_LAYOUT, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def check_vec_layout(dtype: torch.dtype = torch.float32) -> None:
    """Round-trip K/V through vLLM's cache writer and the layout the tree
    kernel reads (``split_vec_kv_cache``).

    Raises if the installed vLLM stores the vec layout differently, so a
    layout change fails loudly at start-up instead of producing wrong tree
    attention.
    """
    generator = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, block_size, head_size = 3, 2, 32, 32
    kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size,
                           dtype=dtype)
    num_tokens = 2 * block_size + 5
    keys = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    block_table_row = torch.tensor([2, 0, 1], dtype=torch.int32)
    positions = torch.arange(num_tokens)
    blocks = block_table_row[positions // block_size].long()
    offsets = positions % block_size
    write_vec_kv_cache(kv_cache, keys, values, blocks * block_size + offsets)
    key_cache, value_cache = split_vec_kv_cache(kv_cache)
    read_keys = key_cache[blocks, :, :, offsets]
    read_values = value_cache[blocks, :, offsets, :]
    if not (torch.equal(read_keys, keys) and torch.equal(read_values, values)):
        raise RuntimeError(
            "vllm-esp: the CPU KV-cache 'vec' layout of this vLLM differs from "
            "the one ESP tree attention reads; this vLLM version is not "
            "supported by vllm-esp.")
