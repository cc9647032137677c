# SPDX-License-Identifier: Apache-2.0
"""vLLM's leftover files in /dev/shm: find them and remove the unused ones
(the TP and Ray tests' clean-up; see conftest.shm_cleanup)."""

from __future__ import annotations

import contextlib
import os

# vLLM's shared-memory files: MessageQueue buffers (psm_*), the CPU
# communicator's all-reduce buffers (*cpushm_*) and multiprocessing
# semaphores (sem.mp-*). Ray's executor kills its workers, so theirs are
# never unlinked; multiprocessing workers sometimes leave them too.
SHM = "/dev/shm"
SHM_PATTERNS = ("psm_*", "*cpushm_*", "sem.mp-*")


def _our_pids() -> set[int]:
    """This process and all its descendants (engine cores, workers, Ray)."""
    import psutil

    me = psutil.Process()
    return {me.pid} | {child.pid for child in me.children(recursive=True)}


def _shm_users() -> dict[str, set[int]]:
    """Which live processes map or hold open each /dev/shm file."""
    users: dict[str, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        names = set()
        try:
            with open(f"/proc/{entry}/maps") as f:
                names |= {line.split(SHM + "/", 1)[1].strip() for line in f
                          if SHM + "/" in line}
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    names.add(target[len(SHM) + 1:])
        except OSError:
            continue
        for name in names:
            users.setdefault(name, set()).add(int(entry))
    return users


def vllm_shm_files() -> set[str]:
    from fnmatch import fnmatch

    return {name for name in os.listdir(SHM)
            if any(fnmatch(name, p) for p in SHM_PATTERNS)}


def remove_unused_shm_files(before: set[str], wait: float = 60) -> set[str]:
    """Remove vLLM's /dev/shm files that are new since ``before`` and that no
    live process uses; return the new files this process's own descendants
    still hold after ``wait`` seconds (a process that outlived its engine).

    A concurrent vLLM run on the same machine keeps its own files: only
    files present before the in-use scan and at least 5 s old are removed
    (a file created after the scan would look unused, and its engine's
    start-up would then fail with FileNotFoundError in SemLock._rebuild)."""
    import time

    deadline = time.time() + wait
    while True:
        scanned = vllm_shm_files() - before
        users, ours = _shm_users(), _our_pids()
        held = {name for name in scanned if users.get(name, set()) & ours}
        if not held or time.time() > deadline:
            break
        time.sleep(1)
    now = time.time()

    def settled(name: str) -> bool:
        try:
            return now - os.stat(os.path.join(SHM, name)).st_mtime > 5
        except FileNotFoundError:
            return False

    removed = sorted(name for name in scanned if not users.get(name) and settled(name))
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM, name))
    if removed:
        print(f"removed from {SHM}: {removed}")
    return held


