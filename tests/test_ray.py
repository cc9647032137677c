# SPDX-License-Identifier: Apache-2.0
"""ESP under tensor parallelism (TP=2) on vLLM's Ray executor, on CPU.

Stock vLLM refuses Ray on the CPU platform (it has no Ray device key), so
these tests start a local one-node Ray cluster with a custom resource and
put the test-only shim in ``tests/ray_shim/`` on PYTHONPATH: every Python
process started from here on (engine core, Ray workers, ``vllm serve``)
imports it through ``sitecustomize`` (see ``esp_ray_shim.py`` for what it
overrides and why). The shipped package carries none of it. The ESP plugin
itself reaches the Ray workers through its ``vllm.general_plugins`` entry
point only, which the offline tests check on every worker.

Slow (each TP=2 Ray engine takes up to a minute to start on 2 cores); needs the
``ray`` extra (installed by ./run's set-up):

    ./run python -m pytest tests/test_ray.py -m slow
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from shm_files import remove_unused_shm_files, vllm_shm_files
from test_serve import _counters, serve
from test_tensor_parallel import (
    GEMMA3_KWARGS,
    NEW_TOKENS,
    NUM_PROMPTS,
    TINY_CONFIGS,
    TINY_KWARGS,
    _check_tp2_matches_tp1,
    _gemma3_prompts,
    _tiny_prompts,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHIM_DIR = Path(__file__).parent / "ray_shim"
THREADS_BIND = "0|1"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with two ``esp_cpu_device`` slots, the shim on
    PYTHONPATH of every process it and vLLM start, and RAY_ADDRESS pointing
    vLLM's ``ray.init()`` (in the engine-core process) at it."""
    try:
        import ray
    except ImportError:
        pytest.skip("ray is not installed (pip install -e '.[ray]'; ./run's set-up does)")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on CPU needs two cores")
    sys.path.insert(0, str(SHIM_DIR))
    try:
        import esp_ray_shim
    finally:
        sys.path.remove(str(SHIM_DIR))
    patch = pytest.MonkeyPatch()
    temp_dir = None
    shm_before = vllm_shm_files()
    try:
        patch.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH")) if p))
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", THREADS_BIND)
        # Ray starts its workers at nice 15 (its worker_niceness default):
        # the TP ranks then lose the CPU to every ordinary process, vLLM's own
        # engine core included, and a run can take many times as long as on
        # mp (README). The raylet reads this override at start-up.
        patch.setenv("RAY_worker_niceness", "0")
        # A short private temp dir (Ray's socket paths must stay under 108 bytes).
        temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        ray.init(num_cpus=2, resources={esp_ray_shim.RESOURCE: 2}, include_dashboard=False,
                 _temp_dir=temp_dir)
        patch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        yield esp_ray_shim
    finally:
        ray.shutdown()
        patch.undo()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert not _ray_processes_left(), "Ray processes outlived ray.shutdown()"
    # Ray's idle workers may still map a finished engine's buffers when a
    # test's own clean-up runs; once the cluster is gone, nothing may remain.
    remove_unused_shm_files(shm_before, wait=10)
    left = vllm_shm_files() - shm_before
    assert not left, f"Ray tests left {sorted(left)} in /dev/shm"


def _ray_processes_left(wait: float = 30) -> list[str]:
    """Ray's own processes (raylet, GCS, workers) still below this one."""
    import psutil

    deadline = time.time() + wait
    while True:
        left = []
        for child in psutil.Process().children(recursive=True):
            try:
                command = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if any(word in command for word in ("raylet", "gcs_server", "ray::", "ray/_private")):
                left.append(command[:100])
        if not left or time.time() > deadline:
            return left
        time.sleep(1)


@pytest.fixture
def ray_tp2(ray_cluster, shm_cleanup, monkeypatch):
    # Lets LLM.collective_rpc send esp_ray_shim.worker_report to the workers.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    return ray_cluster


def _check_workers(reports):
    """Each TP rank is a Ray actor of its own, bound to its own core, at
    normal priority, built as the ESP worker, with the ESP plugin loaded by
    vLLM's plugin loader (nothing set by hand on the workers)."""
    assert len(reports) == 2
    for rank, report in enumerate(reports):
        assert report["ray_actor"], report
        assert report["worker_cls"] == "ESPCPUWorker", report
        assert report["vllm_plugins_loaded"] and report["esp_plugin_registered"], report
        assert report["cpus"] == [int(c) for c in THREADS_BIND.split("|")[rank].split(",")]
        assert report["torch_threads"] == 1 and report["niceness"] == 0, report
    assert len({r["pid"] for r in reports}) == 2


@pytest.mark.parametrize("speculative_config", TINY_CONFIGS)
def test_ray_tp2_tiny_llama(tiny_llama_dir, ray_tp2, speculative_config):
    _, reports = _check_tp2_matches_tp1(
        tiny_llama_dir, _tiny_prompts(), speculative_config, executor="ray",
        worker_probe=ray_tp2.worker_report, **TINY_KWARGS)
    _check_workers(reports)


def test_ray_tp2_gemma3(ray_tp2, questions):
    model, prompts = _gemma3_prompts(questions)
    _, reports = _check_tp2_matches_tp1(
        model, prompts, {"method": "esp"}, executor="ray",
        worker_probe=ray_tp2.worker_report, **GEMMA3_KWARGS)
    _check_workers(reports)


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tmp_path_factory):
    from vllm_esp_dev.testing import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama_tok")
    make_tiny_llama(path, seed=0, with_tokenizer=True)
    return str(path)


def test_ray_tp2_serve_concurrent(ray_tp2, tiny_llama_with_tokenizer, tmp_path):
    """``vllm serve --tensor-parallel-size 2 --distributed-executor-backend
    ray`` with ESP answers concurrent greedy requests with vLLM's plain
    TP=1 output."""
    from vllm import SamplingParams

    from vllm_esp_dev.runs import run_once

    model = tiny_llama_with_tokenizer
    prompts = _tiny_prompts()
    args = [model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
            "--max-num-seqs", str(NUM_PROMPTS), "--seed", "0",
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
            "--speculative-config", json.dumps({"method": "esp"})]

    def complete(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        response = requests.post(base + "/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    with serve(args, tmp_path / "server.log") as base:
        before = _counters(base)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(complete, prompts))
        after = _counters(base)

    plain = run_once(model, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True),
                     max_model_len=512, max_num_seqs=NUM_PROMPTS)
    mismatched = [i for i, (s, p) in enumerate(zip(served, plain.token_ids)) if s != p]
    assert not mismatched, f"served Ray TP=2 ESP outputs differ for prompts {mismatched}"
    assert all(len(s) == NEW_TOKENS for s in served)
    assert after["num_drafts"] > before["num_drafts"]
