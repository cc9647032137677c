# SPDX-License-Identifier: Apache-2.0
"""ESP's CPU kernels (``csrc/tree_attention.cpp``), compiled on first use.

``torch.ops.vllm_esp.tree_attention`` attends each ESP block row to its
request's committed prefix, read in place from vLLM's paged CPU cache, and to
the block rows its tree mask allows, in one pass. ``copy_slots`` moves the
accepted path's K/V inside every layer's cache in one call.

The source is compiled with the C++ compiler torch uses (``c++`` / ``g++``)
the first time an ESP worker starts, in about 10 s, and cached under
``$VLLM_ESP_CACHE/kernels`` (default ``~/.cache/vllm-esp/kernels``) keyed by
the source, torch's version and this CPU; later starts load the cached
library. Concurrent first starts (tensor-parallel workers, parallel tests)
serialise on a lock file. If the build fails, :func:`load` raises with the
compiler's message; the ESP worker then refuses to start rather than run a
slow path silently.

Only built and checked on x86-64 Linux (AVX-512) with vLLM's CPU wheel.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

# Under "vllm." so that vLLM's logging configuration (format, level,
# VLLM_LOGGING_LEVEL) applies to ESP's messages too.
logger = logging.getLogger("vllm.esp")

SOURCE = Path(__file__).resolve().parent / "csrc" / "tree_attention.cpp"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU build; without it the
# kernel runs on one thread. The library then shares torch's libgomp.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
_loaded = False


def cache_root() -> Path:
    root = os.environ.get("VLLM_ESP_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-esp"


def cpu_fingerprint() -> str:
    """Model name and flags: -march=native code only runs on the CPU it was
    built for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines()
             if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(FLAGS).encode(),
                 platform.machine().encode(), cpu_fingerprint().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load() -> None:
    """Compile (once per machine) and load the kernels into ``torch.ops.vllm_esp``."""
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load as load_extension

    build_dir = cache_root() / "kernels" / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    with _lock(build_dir / ".lock"):
        if not (build_dir / "vllm_esp_kernels.so").exists():
            logger.info("vllm-esp: compiling the tree-attention kernel into %s "
                        "(first use on this machine, ~10 s)", build_dir)
        load_extension(name="vllm_esp_kernels", sources=[str(SOURCE)],
                       extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                       build_directory=str(build_dir),
                       is_python_module=False, verbose=False)
    _loaded = True

