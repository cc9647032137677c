# SPDX-License-Identifier: Apache-2.0
"""Tree-attention designs for ESP on vLLM's CPU paged cache, side by side.

    ./run python -m benchmarks.tree_attention_designs [--out FILE.md]

One attention layer's work for the ESP blocks of a batch (SmolLM2-135M's
shape: 9 query heads, 3 KV heads, head size 64; cache block size 128), at
batch 1 and 8, about 128 and 1,024 tokens of context, 10 and 30 block rows,
fp32. Every design computes the same rows (checked against the first) and is
timed interleaved with the others, median of ``--repeats`` calls:

* ``vllm chain``: vLLM's own kernel (``cpu_attention_with_kv_cache``) on the
  same rows as a causal chain: the cost a chain verification of that many
  rows pays, the yardstick.
* ``gather + torch``: the design ESP shipped before: vLLM's kernel for every
  row, then each block gathered out of the paged cache into a dense tensor
  and recomputed in torch with its tree mask.
* ``split + merge``: the paged prefix attended by a kernel that also
  returns the log-sum-exp (ESP's kernel with ``lse``; vLLM's CPU kernel
  returns none), the block's own rows in torch under the tree mask, the two
  merged by log-sum-exp, as vLLM's cascade attention and FlashAttention's
  DCP path do on GPU.
* ``fused``: ESP's kernel: prefix read in place and block rows under the
  tree mask in one online-softmax pass (what ESP uses).

The tree is the hybrid-like shape of a star with one mask per node
(``block_layout(static_tree([Q/2 - 1]))``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPE = dict(num_heads=9, num_kv_heads=3, head_size=64, block_size=128)


def make_batch(batch: int, context: int, rows: int, seed: int = 0):
    from vllm import _custom_ops as ops

    from vllm_esp.attention import write_vec_kv_cache
    from vllm_esp.core.tree import block_layout, static_tree

    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_size, block_size = (SHAPE[k] for k in (
        "num_heads", "num_kv_heads", "head_size", "block_size"))
    layout = block_layout(static_tree([rows // 2 - 1]))
    per_request = (context + rows + block_size - 1) // block_size
    num_blocks = batch * per_request + 2
    table = torch.randperm(num_blocks, generator=generator)[:batch * per_request]
    table = table.view(batch, per_request).to(torch.int32)
    cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_size)
    tokens = batch * rows
    query = torch.randn(tokens, heads, head_size, generator=generator)
    key = torch.randn(tokens, kv_heads, head_size, generator=generator)
    value = torch.randn(tokens, kv_heads, head_size, generator=generator)
    for b in range(batch):
        positions = torch.arange(context + rows)
        slots = table[b][positions // block_size].long() * block_size + positions % block_size
        write_vec_kv_cache(
            cache,
            torch.cat([torch.randn(context, kv_heads, head_size, generator=generator),
                       key[b * rows:(b + 1) * rows]]),
            torch.cat([torch.randn(context, kv_heads, head_size, generator=generator),
                       value[b * rows:(b + 1) * rows]]),
            slots)
    query_start = torch.arange(0, tokens + 1, rows, dtype=torch.int32)
    seq_lens = torch.full((batch,), context + rows, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size,
        seq_lens=seq_lens, dtype=torch.float32, query_start_loc=query_start, causal=True,
        sliding_window_size=-1, isa="vec", enable_kv_split=False)
    masks = layout.attention_mask.expand(batch, rows, rows).contiguous()
    offsets = layout.position_offsets.to(torch.int32).expand(batch, rows).contiguous()
    return dict(batch=batch, context=context, rows=rows, cache=cache, table=table,
                query=query, key=key, value=value, query_start=query_start,
                seq_lens=seq_lens, metadata=metadata, masks=masks, offsets=offsets,
                prefix=torch.full((batch,), context, dtype=torch.int32),
                num_rows=torch.full((batch,), rows, dtype=torch.int32),
                scale=head_size ** -0.5)


def vllm_chain(d, out):
    from vllm import _custom_ops as ops

    halves = d["cache"].view(d["cache"].shape[0], SHAPE["num_kv_heads"],
                             2 * SHAPE["block_size"], SHAPE["head_size"])
    key_cache, value_cache = halves.chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(
        query=d["query"], key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=d["query_start"], seq_lens=d["seq_lens"], scale=d["scale"],
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=d["table"],
        softcap=0.0, scheduler_metadata=d["metadata"], s_aux=None, dynamic_causal=None)


def fused(d, out):
    torch.ops.vllm_esp.tree_attention(
        out, d["query"], d["key"], d["value"], d["cache"], d["table"],
        d["query_start"][:-1].contiguous(), d["num_rows"], d["prefix"], d["masks"],
        d["offsets"], d["scale"], -1)


def _block_part(d):
    """[B, H, Q, D] outputs and [B, H, Q] log-sum-exps of the block rows
    attending to each other under the tree mask."""
    batch, rows = d["batch"], d["rows"]
    heads, kv_heads = SHAPE["num_heads"], SHAPE["num_kv_heads"]
    query = d["query"].view(batch, rows, heads, -1).transpose(1, 2)
    key = d["key"].view(batch, rows, kv_heads, -1).transpose(1, 2)
    value = d["value"].view(batch, rows, kv_heads, -1).transpose(1, 2)
    key = key.repeat_interleave(heads // kv_heads, dim=1)
    value = value.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * d["scale"]
    scores = scores.masked_fill(~d["masks"][:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), value), lse


def split_merge(d, out):
    tokens, heads = d["query"].shape[:2]
    lse = torch.empty(tokens, heads)
    prefix_out = torch.empty_like(d["query"])
    torch.ops.vllm_esp.tree_attention(
        prefix_out, d["query"], d["key"], d["value"], d["cache"], d["table"],
        d["query_start"][:-1].contiguous(), d["num_rows"], d["prefix"], d["masks"],
        d["offsets"], d["scale"], -1, lse)
    block_out, block_lse = _block_part(d)
    batch, rows = d["batch"], d["rows"]
    prefix_lse = lse.view(batch, rows, heads).transpose(1, 2)
    total = torch.logaddexp(prefix_lse, block_lse)
    prefix_weight = torch.exp(prefix_lse - total)[..., None]
    block_weight = torch.exp(block_lse - total)[..., None]
    merged = (prefix_out.view(batch, rows, heads, -1).transpose(1, 2) * prefix_weight
              + block_out * block_weight)
    out.copy_(merged.transpose(1, 2).reshape(tokens, heads, -1))


def gather_torch(d, out):
    """The design ESP shipped before (commit 114b16f): vLLM's kernel on every
    row, then every block recomputed from a dense copy of its prefix."""
    from vllm_esp.attention import split_vec_kv_cache

    vllm_chain(d, out)
    batch, rows, context = d["batch"], d["rows"], d["context"]
    key_cache, value_cache = split_vec_kv_cache(d["cache"])
    positions = torch.arange(context)
    blocks = d["table"].long()[:, positions // SHAPE["block_size"]]
    offsets = (positions % SHAPE["block_size"]).expand_as(blocks)
    prefix_keys = key_cache[blocks, :, :, offsets]
    prefix_values = value_cache[blocks, :, offsets, :]
    kv_heads, heads = SHAPE["num_kv_heads"], SHAPE["num_heads"]
    keys = torch.cat([prefix_keys, d["key"].view(batch, rows, kv_heads, -1)], dim=1)
    values = torch.cat([prefix_values, d["value"].view(batch, rows, kv_heads, -1)], dim=1)
    allowed = torch.cat([torch.ones(batch, rows, context, dtype=torch.bool), d["masks"]],
                        dim=2)
    group = heads // kv_heads
    query = d["query"].view(batch, rows, kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    query = query.reshape(batch, kv_heads, group * rows, -1)
    scores = torch.matmul(query, keys.permute(0, 2, 3, 1)) * d["scale"]
    scores = scores.view(batch, kv_heads, group, rows, -1)
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    attended = torch.matmul(probs.view(batch, kv_heads, group * rows, -1),
                            values.permute(0, 2, 1, 3))
    attended = attended.view(batch, kv_heads, group, rows, -1).permute(0, 3, 1, 2, 4)
    out.copy_(attended.reshape(batch * rows, heads, -1))


DESIGNS = {"vllm chain": vllm_chain, "gather + torch": gather_torch,
           "split + merge": split_merge, "fused": fused}


def measure(d, repeats: int) -> dict[str, float]:
    outputs = {name: torch.empty_like(d["query"]) for name in DESIGNS}
    for name, fn in DESIGNS.items():
        fn(d, outputs[name])
    for name in ("gather + torch", "split + merge"):
        torch.testing.assert_close(outputs[name], outputs["fused"], atol=1e-4, rtol=1e-4)
    times = {name: [] for name in DESIGNS}
    for _ in range(repeats):
        for name, fn in DESIGNS.items():
            start = time.perf_counter()
            fn(d, outputs[name])
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tree_attention_designs")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rows", type=int, nargs="+", default=[10, 30],
                        help="block rows, even (a star with one mask per node)")
    args = parser.parse_args(argv)
    if any(rows < 4 or rows % 2 for rows in args.rows):
        parser.error(f"--rows: even numbers of at least 4, got {args.rows}")
    from vllm_esp import kernels

    kernels.load()
    lines = ["| batch | context | rows | " + " | ".join(
        f"{name} (x chain)" for name in DESIGNS if name != "vllm chain") + " |",
        "|---|---|---|" + "---|" * (len(DESIGNS) - 1)]
    for batch in args.batch_sizes:
        for context in args.contexts:
            for rows in args.rows:
                times = measure(make_batch(batch, context, rows), args.repeats)
                chain = times["vllm chain"]
                lines.append(f"| {batch} | {context} | {rows} | " + " | ".join(
                    f"{times[name] / chain:.2f}x" for name in DESIGNS
                    if name != "vllm chain") + " |")
                print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table)


if __name__ == "__main__":
    main()
