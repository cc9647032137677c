# SPDX-License-Identifier: Apache-2.0
"""ESP's CPU tree attention against a dense per-path reference.

Random batches mix ESP blocks (random trees, some nodes masked, k = 1 or
2) with plain requests (decodes and prefill chunks), each request with its
own prefix length and a shuffled (non-contiguous) block table. The K/V of
every position are written into a paged cache with vLLM's own writer. The
reference recomputes every row in float64 from the dense K/V of exactly
the positions that row may see: for a plain row, its causal prefix; for an
ESP row, the committed prefix plus the block rows its tree mask allows (the
root, its ancestors and itself, and for a mask row its earlier masks), all
within the sliding window if there is one.

The first test drives the C++ kernel directly, the second the vLLM
attention backend (``ESPCPUAttentionImpl.forward`` on the metadata split
that ``ESPCPUAttentionMetadataBuilder`` builds), which must send plain
requests to vLLM's kernel and ESP blocks to the tree kernel.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from vllm_esp.core.tree import TreeSpec, block_layout


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from vllm_esp import kernels as esp_kernels

    esp_kernels.load()


def random_tree(rng: random.Random, max_nodes: int) -> TreeSpec:
    """Random tree in BFS order, k in {1, 2}, masks on a random subset."""
    num_nodes = rng.randint(1, max_nodes)
    parents, depths = [-1], [0]
    for node in range(1, num_nodes):
        parents.append(rng.randrange(node))
        depths.append(depths[parents[-1]] + 1)
    # Renumber by (depth, creation): parents then precede their children.
    order = sorted(range(num_nodes), key=lambda n: (depths[n], n))
    new_id = {old: new for new, old in enumerate(order)}
    parents = [-1] + [new_id[parents[old]] for old in order[1:]]
    masked = tuple(rng.random() < 0.6 for _ in range(num_nodes))
    return TreeSpec(tuple(parents), num_mask_tokens=rng.choice([1, 2]), masked=masked)


def build_batch(seed: int, dtype: torch.dtype, window: int, block_size: int,
                num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 32,
                only_blocks: bool = False):
    """A flat batch: per request either an ESP block or a plain query of
    1..20 rows after a prefix (``only_blocks``: blocks only); cache filled
    through vLLM's writer."""
    from vllm_esp.attention import write_vec_kv_cache

    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for index in range(rng.randint(3, 6)):
        # The first request is an ESP block with a prefix longer than any
        # window tested, so windows always cut into it.
        prefix = 257 if index == 0 else rng.choice([0, 1, 5, 31, 32, 33, 100, 257])
        if only_blocks or index % 2 == 0 or rng.random() < 0.3:
            layout = block_layout(random_tree(rng, 12))
            requests.append({"prefix": prefix, "rows": layout.block_size,
                             "layout": layout})
        else:
            requests.append({"prefix": prefix, "rows": rng.choice([1, 1, 3, 20]),
                             "layout": None})
    blocks_per_request = [math.ceil((r["prefix"] + r["rows"]) / block_size) + 1
                          for r in requests]
    num_cache_blocks = sum(blocks_per_request) + 3
    physical = torch.randperm(num_cache_blocks, generator=generator)
    max_blocks = max(blocks_per_request)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks_per_request):
        block_table[i, :count] = physical[used:used + count].to(torch.int32)
        used += count
    kv_cache = torch.zeros(num_cache_blocks, num_kv_heads, block_size, 2 * head_size,
                           dtype=dtype)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    queries, keys, values, query_start = [], [], [], [0]
    for i, request in enumerate(requests):
        prefix, rows = request["prefix"], request["rows"]
        request["prefix_keys"] = rand(prefix, num_kv_heads, head_size)
        request["prefix_values"] = rand(prefix, num_kv_heads, head_size)
        request["query"] = rand(rows, num_heads, head_size)
        request["keys"] = rand(rows, num_kv_heads, head_size)
        request["values"] = rand(rows, num_kv_heads, head_size)
        # The prefix and the step's own rows, at linear positions.
        positions = torch.arange(prefix + rows)
        slots = (block_table[i][positions // block_size].long() * block_size
                 + positions % block_size)
        write_vec_kv_cache(kv_cache,
                           torch.cat([request["prefix_keys"], request["keys"]]),
                           torch.cat([request["prefix_values"], request["values"]]),
                           slots)
        queries.append(request["query"])
        keys.append(request["keys"])
        values.append(request["values"])
        query_start.append(query_start[-1] + rows)
    # Queries/keys as strided views of one wider tensor, as a model's fused
    # qkv projection hands them to attention.
    q = torch.cat(queries)
    k = torch.cat(keys)
    v = torch.cat(values)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_width, k_width = q[0].numel(), k[0].numel()
    q = fused[:, :q_width].view(-1, num_heads, head_size)
    k = fused[:, q_width:q_width + k_width].view(-1, num_kv_heads, head_size)
    v = fused[:, q_width + k_width:].view(-1, num_kv_heads, head_size)
    return SimpleNamespace(requests=requests, kv_cache=kv_cache, block_table=block_table,
                           query=q, key=k, value=v,
                           query_start=torch.tensor(query_start, dtype=torch.int32),
                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_size=head_size, window=window, block_size=block_size)


def reference_output(batch) -> torch.Tensor:
    """Every row, in float64, from the dense K/V of the positions it sees."""
    scale = batch.head_size ** -0.5
    group = batch.num_heads // batch.num_kv_heads
    outputs = []
    for request in batch.requests:
        prefix, rows, layout = request["prefix"], request["rows"], request["layout"]
        keys = torch.cat([request["prefix_keys"], request["keys"]]).double()
        values = torch.cat([request["prefix_values"], request["values"]]).double()
        if layout is None:
            positions = torch.arange(prefix + rows)
            row_positions = prefix + torch.arange(rows)
            visible = positions[None, :] <= row_positions[:, None]
        else:
            offsets = layout.position_offsets
            positions = torch.cat([torch.arange(prefix), prefix + offsets])
            row_positions = prefix + offsets
            visible = torch.cat([torch.ones(rows, prefix, dtype=torch.bool),
                                 layout.attention_mask], dim=1)
        if batch.window > 0:
            visible &= row_positions[:, None] - positions[None, :] < batch.window
        query = request["query"].double()
        out = torch.zeros(rows, batch.num_heads, batch.head_size, dtype=torch.float64)
        for head in range(batch.num_heads):
            kv_head = head // group
            scores = query[:, head] @ keys[:, kv_head].T * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            out[:, head] = torch.softmax(scores, dim=-1) @ values[:, kv_head]
        outputs.append(out)
    return torch.cat(outputs)


def tree_inputs(batch, only_blocks: bool = True):
    blocks = [i for i, r in enumerate(batch.requests) if r["layout"] is not None]
    max_rows = max(batch.requests[i]["rows"] for i in blocks)
    masks = torch.zeros(len(blocks), max_rows, max_rows, dtype=torch.bool)
    offsets = torch.zeros(len(blocks), max_rows, dtype=torch.int32)
    for slot, i in enumerate(blocks):
        layout = batch.requests[i]["layout"]
        size = layout.block_size
        masks[slot, :size, :size] = layout.attention_mask
        offsets[slot, :size] = layout.position_offsets.to(torch.int32)
    return SimpleNamespace(
        batch_indices=torch.tensor(blocks),
        num_rows=torch.tensor([batch.requests[i]["rows"] for i in blocks], dtype=torch.int32),
        prefix_lens=torch.tensor([batch.requests[i]["prefix"] for i in blocks],
                                 dtype=torch.int32),
        tree_masks=masks, position_offsets=offsets)


def block_rows(batch) -> torch.Tensor:
    rows = [torch.arange(int(batch.query_start[i]), int(batch.query_start[i + 1]))
            for i, r in enumerate(batch.requests) if r["layout"] is not None]
    return torch.cat(rows)


CASES = [
    # (seed, dtype, sliding window, cache block size, heads, kv heads, head size)
    (0, torch.float32, 0, 32, 4, 2, 32),
    (1, torch.float32, 0, 128, 4, 1, 64),
    (2, torch.float32, 40, 32, 4, 2, 32),
    (3, torch.float32, 7, 64, 6, 2, 64),
    (4, torch.bfloat16, 0, 32, 4, 2, 32),
    (5, torch.bfloat16, 40, 128, 8, 2, 64),
    (6, torch.float32, 0, 32, 3, 3, 128),
]


@pytest.mark.parametrize("seed, dtype, window, block_size, heads, kv_heads, head_size", CASES)
def test_kernel_matches_dense_per_path_reference(seed, dtype, window, block_size, heads,
                                                 kv_heads, head_size):
    batch = build_batch(seed, dtype, window, block_size, heads, kv_heads, head_size)
    tree = tree_inputs(batch)
    output = torch.full_like(batch.query, float("nan")).contiguous()
    torch.ops.vllm_esp.tree_attention(
        output, batch.query, batch.key, batch.value, batch.kv_cache,
        batch.block_table[tree.batch_indices], batch.query_start[tree.batch_indices],
        tree.num_rows, tree.prefix_lens, tree.tree_masks, tree.position_offsets,
        head_size ** -0.5, window)
    rows = block_rows(batch)
    expected = reference_output(batch)[rows]
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output[rows].double(), expected, atol=tolerance,
                               rtol=tolerance)
    # Rows of plain requests are left to vLLM's kernel: untouched.
    plain = torch.ones(len(output), dtype=torch.bool)
    plain[rows] = False
    assert torch.isnan(output[plain]).all()


def test_kernel_splits_long_prefixes_across_threads_exactly():
    """One block with a long prefix takes the split (flash-decoding) path
    when there are fewer (block, head) pairs than threads: same result."""
    batch = build_batch(11, torch.float32, 0, 32, 2, 1, 32)
    request = batch.requests[0]
    assert request["layout"] is not None
    tree = tree_inputs(batch)
    rows = block_rows(batch)
    expected = reference_output(batch)[rows]
    threads = torch.get_num_threads()
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            output = torch.zeros_like(batch.query).contiguous()
            torch.ops.vllm_esp.tree_attention(
                output, batch.query, batch.key, batch.value, batch.kv_cache,
                batch.block_table[tree.batch_indices],
                batch.query_start[tree.batch_indices], tree.num_rows, tree.prefix_lens,
                tree.tree_masks, tree.position_offsets, 32 ** -0.5, 0)
            torch.testing.assert_close(output[rows].double(), expected, atol=2e-5,
                                       rtol=2e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("seed, dtype, window, only_blocks", [(20, torch.float32, 0, False),
                                                              (21, torch.float32, 24, False),
                                                              (22, torch.bfloat16, 0, False),
                                                              (23, torch.float32, 24, True)])
def test_backend_forward_matches_reference_for_mixed_batches(seed, dtype, window,
                                                             only_blocks, monkeypatch):
    """The backend splits a step with ESP blocks: prefill chunks through
    vLLM's kernel, blocks and plain decodes through the tree kernel; every
    row must match. (Seed 21 has both a decode and a chunk beside its
    blocks; 20 and 22 only decodes; 23 only blocks, the builder's shortcut.)"""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from vllm_esp.attention import ESPCPUAttentionImpl, ESPCPUAttentionMetadataBuilder

    batch = build_batch(seed, dtype, window, 32, only_blocks=only_blocks)
    num_reqs = len(batch.requests)
    seq_lens = torch.tensor([r["prefix"] + r["rows"] for r in batch.requests],
                            dtype=torch.int32)
    num_tokens = int(batch.query_start[-1])
    metadata = CPUAttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=int((batch.query_start[1:] - batch.query_start[:-1]).max()),
        query_start_loc=batch.query_start, max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens, block_table=batch.block_table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_reqs, num_heads=batch.num_heads,
            num_kv_heads=batch.num_kv_heads, head_dim=batch.head_size,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=batch.query_start,
            causal=True, sliding_window_size=window if window else -1, isa="vec",
            enable_kv_split=False),
        causal=True)
    # The builder's split, on a builder that has only what _split reads.
    builder = object.__new__(ESPCPUAttentionMetadataBuilder)
    builder.num_heads, builder.num_kv_heads = batch.num_heads, batch.num_kv_heads
    builder.head_dim, builder.dtype = batch.head_size, dtype
    builder.window_size = window if window else -1
    builder.isa, builder.kv_cache_dtype = "vec", "auto"
    split = builder._split(metadata, tree_inputs(batch),
                           SimpleNamespace(num_reqs=num_reqs))
    # One-row plain queries join the blocks in the tree kernel; longer ones
    # (prefill chunks) stay with vLLM's kernel.
    decodes = [i for i, r in enumerate(batch.requests)
               if r["layout"] is None and r["rows"] == 1]
    chunks = [i for i, r in enumerate(batch.requests)
              if r["layout"] is None and r["rows"] > 1]
    assert bool(decodes) != only_blocks, "a plain decode beside the blocks, or none"
    assert split.tree.num_rows.numel() == len(batch.requests) - len(chunks)
    if chunks:
        assert split.plain.num_actual_tokens == sum(batch.requests[i]["rows"]
                                                    for i in chunks)
    else:
        assert split.plain is None
    from vllm.v1.attention.backends import cpu_attn

    # The impl reads only the model dtype from vLLM's config.
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))
    impl = ESPCPUAttentionImpl(
        num_heads=batch.num_heads, head_size=batch.head_size,
        scale=batch.head_size ** -0.5, num_kv_heads=batch.num_kv_heads,
        alibi_slopes=None, sliding_window=window or None, kv_cache_dtype="auto")
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    output = torch.full((num_tokens, batch.num_heads, batch.head_size), float("nan"),
                        dtype=dtype)
    impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, split,
                 output)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.double(), reference_output(batch),
                               atol=tolerance, rtol=tolerance)
