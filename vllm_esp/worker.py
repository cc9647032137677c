# SPDX-License-Identifier: Apache-2.0
"""ESP workers, selected through vLLM's ``worker_cls`` hook.

The ESP engine-args translation sets ``worker_cls`` to one of these only when
``{"method": "esp"}`` is requested. The worker does the two process-local
things ESP needs before the model is built: it registers the tree-attention
backend over ``CPU_ATTN`` (checking the KV layout it reads), and it makes
the CPU worker construct the ESP model runner.
"""

from __future__ import annotations

import contextlib
import logging
import time

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_esp.patching import check_vllm_version, reach, shield_llvmlite_from_kernel_scan

logger = logging.getLogger("vllm.esp")

ESP_CPU_ATTENTION_BACKEND = "vllm_esp.attention.ESPCPUAttentionBackend"


def register_tree_attention() -> None:
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from vllm_esp import kernels
    from vllm_esp.attention import check_vec_layout

    kernels.load()
    check_vec_layout()
    global _previous_cpu_attention_override
    backend = AttentionBackendEnum.CPU_ATTN
    current = backend.get_path() if backend.is_overridden() else None
    # A second ESP engine alive in the same process finds ESP's own entry:
    # what to give back stays what was there before the first one.
    if current != ESP_CPU_ATTENTION_BACKEND:
        _previous_cpu_attention_override = current
    # vLLM's CPU platform always resolves CPU_ATTN, so overriding its path is
    # the registry's supported way to swap the implementation.
    reach("tree attention")
    register_backend(backend, ESP_CPU_ATTENTION_BACKEND)
    _forget_resolved_attention_backends()


def unregister_tree_attention() -> None:
    """Give ``CPU_ATTN`` back to what it was before this ESP engine, so that
    an engine started later in the same process without ESP runs vLLM's own
    backend."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    backend = AttentionBackendEnum.CPU_ATTN
    if backend.get_path() != ESP_CPU_ATTENTION_BACKEND:
        return
    if _previous_cpu_attention_override is None:
        backend.clear_override()
    else:
        register_backend(backend, _previous_cpu_attention_override)
    _forget_resolved_attention_backends()


def _forget_resolved_attention_backends() -> None:
    """vLLM memoises backend resolution per process
    (``selector._cached_get_attn_backend``, checked on 0.32.0). In-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), an engine started earlier without
    ESP had already resolved ``CPU_ATTN`` to vLLM's causal kernel, and the
    ESP engine after it got that class back from the cache: its tree blocks
    were attended causally and greedy output changed. The registry change
    must reach the next model built in this process.

    The memo is private to vLLM. A vLLM without it gets a warning, not a
    failure: a fresh worker process (vLLM's default) has nothing memoised,
    and ``check_tree_attention_in_use`` still refuses to start an engine
    whose layers got another backend."""
    try:
        from vllm.v1.attention import selector
        cache_clear = selector._cached_get_attn_backend.cache_clear
    except (ImportError, AttributeError):
        logger.warning(
            "ESP: vllm.v1.attention.selector._cached_get_attn_backend.cache_clear "
            "is missing (checked on vLLM 0.32.0). ESP cannot forget backends this "
            "process resolved earlier; if an engine without ESP ran in this process "
            "first, ESP's start-up check will refuse to start.")
        return
    cache_clear()


def check_tree_attention_in_use(attn_groups) -> None:
    """Fail at start-up, not with wrong tokens, if any attention layer of
    the model did not get ESP's backend."""
    from vllm_esp.attention import ESPCPUAttentionBackend

    stock = sorted({group.backend.__name__ for groups in attn_groups for group in groups
                    if not issubclass(group.backend, ESPCPUAttentionBackend)})
    if stock:
        raise RuntimeError(
            f"ESP: attention layers were built with {', '.join(stock)}, not ESP's "
            f"tree attention ({ESP_CPU_ATTENTION_BACKEND}); ESP blocks would be "
            "verified with the wrong mask. Please report this with your vLLM version.")
    # The accepted path's K/V is moved through the slot mappings vLLM keeps
    # for its separate KV-cache update op (execute_model_state.slot_mappings);
    # a backend that writes the cache inside its forward has none.
    fused = sorted({group.backend.__name__ for groups in attn_groups for group in groups
                    if getattr(group.backend, "forward_includes_kv_cache_update", True)})
    if fused:
        raise RuntimeError(
            f"ESP: the attention backend {', '.join(fused)} writes the KV cache inside "
            "its forward (forward_includes_kv_cache_update), so ESP cannot move the "
            "accepted drafts' K/V (checked on vLLM 0.32.0, where CPU_ATTN does not). "
            "Please report this with your vLLM version.")


_previous_cpu_attention_override: str | None = None


@contextlib.contextmanager
def _cpu_runner_class(runner_cls):
    """vLLM 0.32/0.33's CPUWorker.init_device builds ``CPUModelRunner`` from
    its module global and has no ``_make_model_runner`` hook (the GPU worker
    does). Rebind the global only while our own init_device runs."""
    from vllm.v1.worker import cpu_worker as cpu_worker_module

    reach("runner class")
    original = cpu_worker_module.CPUModelRunner
    cpu_worker_module.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker_module.CPUModelRunner = original


class ESPCPUWorker(CPUWorker):
    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version()
        from vllm_esp import cpu_kernels

        # vLLM's platform overrides are installed before the worker is
        # built, so this replaces its broken expand kernel (see
        # vllm_esp/cpu_kernels.py).
        cpu_kernels.register()
        register_tree_attention()
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        if self.use_v2_model_runner:
            raise RuntimeError(
                "ESP runs on vLLM's V1 model runner (as custom_class proposers "
                "do); unset VLLM_USE_V2_MODEL_RUNNER.")
        from vllm_esp.runner import ESPCPUModelRunner

        with _cpu_runner_class(ESPCPUModelRunner):
            super().init_device()
        # The runner's kernels loaded numba: keep the next engine's kernel
        # scan in this process working.
        shield_llvmlite_from_kernel_scan()

    def compile_or_warm_up_model(self):
        check_tree_attention_in_use(self.model_runner.attn_groups)
        times = super().compile_or_warm_up_model()
        self.model_runner.esp_profile_step_cost()
        started = time.perf_counter()
        self.model_runner.drafter.warm_up()
        logger.info("ESP: per-step kernels ready in %.1f s",
                    time.perf_counter() - started)
        return times

    def shutdown(self) -> None:
        super().shutdown()
        unregister_tree_attention()

    def esp_row_counts(self) -> dict[str, int]:
        """Cumulative decode request-steps and their verification rows
        (root, tree nodes and mask rows), for benchmarks: offline through
        ``LLM.collective_rpc("esp_row_counts")``."""
        return self.model_runner.esp_row_counts()
