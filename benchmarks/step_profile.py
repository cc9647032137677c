# SPDX-License-Identifier: Apache-2.0
"""Where an engine step goes: a torch-profiler breakdown by part.

``profile_steps(step, n)`` runs ``step()`` ``n`` times under
``torch.profiler`` and splits the steps' wall time into the parts named in
``PARTS``. Each profiler event's *own* time (its duration minus its
children's) goes to the part of its nearest ancestor (itself included) that
``part_of`` recognises; the rest is "other". ESP marks its own scopes with
``vllm_esp.profiling.scope`` (names ``esp: ...``), vLLM its own with
``record_function_or_nullcontext``, which are no-ops unless profiling
scopes are on: ``profile_steps`` turns them on for its own steps only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PARTS = (
    "model matmuls",
    "stock attention",
    "tree attention",
    "KV relocation",
    "mask-logit probe",
    "logits (lm_head)",
    "sampler",
    "proposal and bookkeeping",
    "other model ops",
    "other",
)


SCOPES = {
    "esp: tree attention": "tree attention",
    "esp: relocate kv": "KV relocation",
    "esp: mask probe": "mask-logit probe",
    "esp: sampler": "sampler",
    "gpu_model_runner: postprocess": "logits (lm_head)",
}


def scope_part(name: str) -> str | None:
    """The part of a named scope (ESP's or vLLM's), or None."""
    if name in SCOPES:
        return SCOPES[name]
    if name.startswith("esp: "):
        return "proposal and bookkeeping"
    return None


def op_part(name: str) -> str | None:
    """The part of an op inside the model forward, or None."""
    if name == "_C::cpu_attention_with_kv_cache":
        return "stock attention"
    if name in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul",
                "aten::bmm") or "gemm" in name.lower() or "onednn" in name.lower():
        return "model matmuls"
    return None


def part_of(names: list[str]) -> str:
    """``names``: an event's name, then its ancestors' (innermost first).
    The innermost scope wins; inside the model forward (and no scope), the
    innermost recognised op decides; anything else is "other"."""
    for name in names:
        part = scope_part(name)
        if part is not None:
            return part
    if "gpu_model_runner: forward" in names:
        for name in names:
            part = op_part(name)
            if part is not None:
                return part
        return "other model ops"
    return "other"


def profile_steps(step: Callable[[], object], num_steps: int) -> dict:
    import torch
    import vllm.v1.utils as vllm_utils
    from torch.profiler import ProfilerActivity, profile, record_function

    # vLLM caches its choice of scope function on first use; switch it to
    # real profiler ranges for these steps only.
    saved = vllm_utils._PROFILER_FUNC
    vllm_utils._PROFILER_FUNC = record_function
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            start = time.perf_counter()
            for _ in range(num_steps):
                step()
            wall = time.perf_counter() - start
    finally:
        vllm_utils._PROFILER_FUNC = saved
    totals = {part: 0.0 for part in PARTS}
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]

    for event in events:
        own = event.time_range.elapsed_us() - sum(
            child.time_range.elapsed_us() for child in event.cpu_children)
        names, node = [], event
        while node is not None:
            names.append(node.name)
            node = node.cpu_parent
        totals[part_of(names)] += max(own, 0.0) / 1e6
    # Wall time not covered by any event (Python between ops) is "other".
    covered = sum(totals.values())
    totals["other"] += max(wall - covered, 0.0)
    total = sum(totals.values())
    return {"wall_seconds": wall, "steps": num_steps,
            "seconds": totals,
            "shares": {k: v / total for k, v in totals.items() if v > 0}}
