"""Shared fixtures. Nothing here downloads from a model hub: the real models
come from PyPI packages (vllm_esp.models) and the tiny ones are random."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    from vllm_esp.models import model_path

    return str(model_path("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def spec_bench():
    from vllm_esp.data import load_spec_bench

    return load_spec_bench()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A seeded random Llama (vocab 512) saved for vLLM, no tokenizer."""
    from vllm_esp.testing import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(path, seed=0)
    return str(path)


# vLLM's shared-memory files: MessageQueue buffers (psm_*), the CPU
# communicator's all-reduce buffers (*cpushm_*) and multiprocessing
# semaphores (sem.mp-*). Ray's executor kills its workers, so theirs are
# never unlinked; multiprocessing workers sometimes leave them too.
_SHM = "/dev/shm"
_SHM_PATTERNS = ("psm_*", "*cpushm_*", "sem.mp-*")


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
                names |= {line.split(_SHM + "/", 1)[1].strip() for line in f
                          if _SHM + "/" in line}
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith(_SHM + "/"):
                    names.add(target[len(_SHM) + 1:])
        except OSError:
            continue
        for name in names:
            users.setdefault(name, set()).add(int(entry))
    return users


@pytest.fixture
def shm_cleanup():
    """Remove the /dev/shm files a test's engines left behind.

    Only files that are new since the test started, match vLLM's names and
    that no live process uses are removed, so a concurrent vLLM run on the
    same machine keeps its own. Fails if one of this test's own processes
    still holds a new file after a minute (a process that outlived its
    engine)."""
    from fnmatch import fnmatch

    before = set(os.listdir(_SHM))

    def new_files() -> set[str]:
        return {name for name in set(os.listdir(_SHM)) - before
                if any(fnmatch(name, p) for p in _SHM_PATTERNS)}

    yield
    import time

    deadline = time.time() + 60
    while True:
        users_snapshot_names = set(os.listdir(_SHM))
        users, ours = _shm_users(), _our_pids()
        held = {name for name in new_files() if users.get(name, set()) & ours}
        if not held or time.time() > deadline:
            break
        time.sleep(1)
    # Only files that existed before the scan above and are not brand new:
    # a concurrent vLLM run creates semaphores and buffers all the time, and
    # one created after the scan would look unused (its engine's start-up
    # then fails with FileNotFoundError in SemLock._rebuild).
    now = time.time()
    candidates = new_files() & set(users_snapshot_names)

    def settled(name: str) -> bool:
        try:
            return now - os.stat(os.path.join(_SHM, name)).st_mtime > 5
        except FileNotFoundError:
            return False

    removed = sorted(name for name in candidates if not users.get(name) and settled(name))
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM, name))
    if removed:
        print(f"removed from {_SHM}: {removed}")
    assert not held, f"this test's processes still hold {sorted(held)} in {_SHM}"
