# SPDX-License-Identifier: Apache-2.0
"""Named profiler scopes for ESP's per-step work.

``scope("esp: tree attention")`` is vLLM's ``record_function_or_nullcontext``:
a no-op unless ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, and then a
``torch.profiler`` range. ``benchmarks/step_profile.py`` groups a step's time
by these names.
"""

from vllm.v1.utils import record_function_or_nullcontext as scope

__all__ = ["scope"]
