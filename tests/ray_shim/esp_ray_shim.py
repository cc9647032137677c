# SPDX-License-Identifier: Apache-2.0
"""Test-only shim: lets vLLM's Ray executor place TP workers on CPU.

Not part of vllm-esp. vLLM's Ray executors (0.32) find their devices through
``current_platform.ray_device_key``; the CPU platform leaves it empty, so
Ray is refused on CPU ("current platform cpu does not support ray"). On GPU
none of this is needed. To test ESP on Ray on this CPU-only machine, the
tests start a Ray cluster with a custom resource (``RESOURCE``, one unit per
TP worker) and this shim makes the CPU platform use it.

It must be active in every process that builds or runs the executor: the
engine-core process (it creates the placement group and the workers), the
Ray worker processes, and a ``vllm serve`` process. ``sitecustomize.py``
next to this file installs it at interpreter start-up when this directory is
on PYTHONPATH; vLLM modules are patched right after they are imported (an
import hook), so processes that never import vLLM (Ray's own) pay nothing.

Overrides, each needed for a TP=2 Ray run on CPU:

1. ``CpuPlatform.ray_device_key = RESOURCE``: placement-group bundles ask for
   one unit of the custom resource per worker instead of a GPU.
2. ``RayWorkerProc.get_node_and_physical_gpu_ids``: stock code reads
   ``ray.get_runtime_context().get_accelerator_ids()[ray_device_key]``,
   which only lists Ray's built-in accelerators (KeyError for a custom
   resource). A CPU worker has no device id, so it returns none; local ranks
   still come from the node ids, as on GPU.
3. ``RayWorkerProc.initialize_worker`` binds each worker to its cores before
   the worker is built. vLLM's CPU thread binding
   (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0|1"``) is applied by the
   multiprocessing executor only (``OMPProcessManager`` sets OMP variables
   for each worker it spawns); Ray starts its workers itself, so without
   this both ranks float over all cores (Ray only sets OMP_NUM_THREADS=1)
   and can share one core, where the all-reduce of one rank spin-waits for
   the other. This uses vLLM's own ``OMPProcessManager`` to compute the
   same CPU list per local rank as the mp executor and pins every thread of
   the worker process to it, and sets torch's thread count to its size (Ray
   has set OMP_NUM_THREADS=1). ``"nobind"`` leaves workers unbound.

Nothing else is needed: shared memory, the gloo/shm communicator and the
message queues work as on mp, and the ESP plugin reaches each worker through
vLLM's ``vllm.general_plugins`` entry point (checked by ``worker_report``).
Only vLLM's default Ray executor (``RayExecutorV2``) is covered.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys

RESOURCE = "esp_cpu_device"


def _patch_platform(module) -> None:
    module.CpuPlatform.ray_device_key = RESOURCE  # override 1


def _bind_worker(vllm_config, local_rank: int) -> None:
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup:
        return
    cpus = set(manager.cpu_lists[local_rank])
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread may have exited
            os.sched_setaffinity(int(tid), cpus)
    import torch

    torch.set_num_threads(len(cpus))


def _patch_ray_executor(module) -> None:
    worker_cls = module.RayWorkerProc

    def get_node_and_physical_gpu_ids(self):  # override 2
        import ray

        return ray.get_runtime_context().get_node_id(), []

    original_initialize = worker_cls.initialize_worker

    def initialize_worker(self, local_rank, env_vars, distributed_init_method,
                          driver_env_vars=None, **kwargs):  # override 3
        # The stock method applies the driver's environment first (without
        # overwriting); do the same so VLLM_CPU_OMP_THREADS_BIND is seen.
        for key, value in (driver_env_vars or {}).items():
            os.environ.setdefault(key, value)
        _bind_worker(self._init_kwargs["vllm_config"], local_rank)
        return original_initialize(self, local_rank, env_vars, distributed_init_method,
                                   driver_env_vars, **kwargs)

    worker_cls.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids
    worker_cls.initialize_worker = initialize_worker


_PATCHES = {
    "vllm.platforms.cpu": _patch_platform,
    "vllm.v1.executor.ray_executor_v2": _patch_ray_executor,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs the patch for a module in ``_PATCHES`` right after it executes."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def worker_report(wrapper) -> dict:
    """Run on each worker through ``LLM.collective_rpc``: what the tests
    check about a Ray worker (vLLM passes its worker wrapper)."""
    import ray
    import torch
    import vllm.plugins

    import vllm_esp.plugin

    return {
        "pid": os.getpid(),
        "ray_actor": ray.get_runtime_context().get_actor_id() is not None,
        "worker_cls": type(getattr(wrapper, "worker", wrapper)).__name__,
        # vLLM's plugin loader ran, and it called the ESP entry point.
        "vllm_plugins_loaded": vllm.plugins.plugins_loaded,
        "esp_plugin_registered": vllm_esp.plugin._registered,
        "cpus": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "niceness": os.nice(0),
    }
