# SPDX-License-Identifier: Apache-2.0
"""Spec-Bench benchmark harness for vllm-esp (``python -m benchmarks.spec_bench``).

Modules:
  * ``metrics``    pure arithmetic on per-request records (tau, forwards per
                   token, tokens/s, percentiles, greedy-match check); no vLLM.
  * ``methods``    the named speculative-decoding configurations.
  * ``offline``    ``LLM.generate`` workloads (one fresh engine per method).
  * ``online``     ``vllm serve`` + a bounded-concurrency load client.
  * ``report``     results.json, results.md and the PNG plots.
  * ``spec_bench`` the command line.

``reference_tau`` (separate) measures tau per category with the transformers
reference decoder, without vLLM.
"""
