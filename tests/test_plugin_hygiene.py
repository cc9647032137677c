# SPDX-License-Identifier: Apache-2.0
"""Installing vllm-esp must not change runs that do not ask for ESP."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

RUN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    if __name__ == "__main__":
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm_esp_dev.runs import run_once
        model = sys.argv[1]
        prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(12 + 5 * i)] for i in range(6)]
        # repeat a pattern so ngram has something to find
        prompts = [p + p[:8] for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        out = {}
        for label, spec in [("plain", None),
                            ("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1})]:
            run = run_once(model, prompts, params, speculative_config=spec,
                           skip_tokenizer_init=True, max_num_seqs=4,
                           max_model_len=512)
            out[label] = {"tokens": run.token_ids, "counters": run.counters}
        out["patched"] = hasattr(EngineArgs.create_engine_config, "__vllm_esp_patch__")
        print("RESULT " + json.dumps(out))
""")


def _run(model_dir, tmp_path, plugins: str | None):
    script = tmp_path / "hygiene_run.py"
    script.write_text(RUN_SCRIPT)
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    result = subprocess.run([sys.executable, str(script), model_dir], env=env,
                            capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.vllm
def test_non_esp_runs_unchanged_by_plugin(tiny_llama_dir, tmp_path):
    with_plugin = _run(tiny_llama_dir, tmp_path, plugins=None)
    # VLLM_PLUGINS lists the general plugins vLLM may load; naming another
    # one keeps vllm-esp's entry point from loading at all.
    without_plugin = _run(tiny_llama_dir, tmp_path, plugins="lora_filesystem_resolver")
    assert with_plugin["patched"] and not without_plugin["patched"]
    for label in ("plain", "ngram"):
        assert with_plugin[label]["tokens"] == without_plugin[label]["tokens"]
        assert with_plugin[label]["counters"] == without_plugin[label]["counters"]
    assert with_plugin["ngram"]["counters"]["vllm:spec_decode_num_drafts"] > 0


def test_runtime_plugin_does_not_import_dev_tools():
    """The modules an ESP engine loads never import the development tools
    (model converter, metadata-alias writer, test proposers) nor gguf."""
    code = textwrap.dedent("""
        import sys
        import vllm_esp.plugin
        vllm_esp.plugin.register()
        import vllm_esp.worker, vllm_esp.runner, vllm_esp.proposer
        import vllm_esp.attention, vllm_esp.scheduler
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in ("vllm_esp_dev", "gguf"))
        print("LOADED", loaded)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=300)
    assert "LOADED []" in result.stdout, result.stdout + result.stderr[-3000:]


IN_PROCESS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process
    if __name__ == "__main__":
        from vllm import SamplingParams
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm_esp_dev.runs import run_once
        model = sys.argv[1]
        prompts = [[(5 * i + 11 * j) % 400 + 1 for j in range(16)] * 2 for i in range(3)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        out = {}
        for label, spec in [("plain", None),
                            ("esp", {"method": "esp"}),
                            ("plain again", None),
                            ("esp again", {"method": "esp", "block_complexity": 10})]:
            run = run_once(model, prompts, params, speculative_config=spec,
                           max_num_seqs=4, max_model_len=512)
            out[label] = {"tokens": run.token_ids, "drafts": run.num_drafts,
                          "cpu_attn_overridden": AttentionBackendEnum.CPU_ATTN.is_overridden()}
        out["numba loaded"] = "numba" in sys.modules
        print("RESULT " + json.dumps(out))
""")


@pytest.mark.vllm
def test_engines_in_one_process_keep_their_own_attention(smollm2_dir, tmp_path):
    """In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in turn:
    plain, ESP, plain, ESP. vLLM memoises the attention backend per process,
    so the first ESP engine used to get the causal kernel the plain engine
    had resolved, and its greedy output changed (a sibling-rich tree on
    these prompts drops a token at position 9 of the first request). Each
    ESP engine must give the plain tokens, and once it has shut down the
    next plain engine must find ``CPU_ATTN`` as vLLM left it. ESP's kernels
    load numba, whose llvmlite ``lib`` object used to make vLLM's kernel
    scan (run by every worker's init) crash the engine after an ESP one."""
    script = tmp_path / "in_process_run.py"
    script.write_text(IN_PROCESS_SCRIPT)
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    result = subprocess.run([sys.executable, str(script), smollm2_dir], env=env,
                            capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["numba loaded"]
    assert out["esp"]["drafts"] > 0 and out["esp again"]["drafts"] > 0
    assert out["esp"]["tokens"] == out["plain"]["tokens"]
    assert out["esp again"]["tokens"] == out["plain again"]["tokens"] == out["plain"]["tokens"]
    # Overridden only while an ESP engine lives (checked after shut-down).
    assert not any(run["cpu_attn_overridden"] for run in out.values()
                   if isinstance(run, dict))


@pytest.mark.vllm
def test_cpu_attn_is_given_back_after_overlapping_esp_workers():
    """Two ESP workers alive in one process, shut down in turn: ``CPU_ATTN``
    must end as vLLM had it, not stay pointed at ESP's backend (the second
    worker must not take ESP's own entry for what to give back)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_esp.worker import (
        ESP_CPU_ATTENTION_BACKEND,
        register_tree_attention,
        unregister_tree_attention,
    )

    backend = AttentionBackendEnum.CPU_ATTN
    assert not backend.is_overridden()
    try:
        register_tree_attention()
        register_tree_attention()
        assert backend.get_path() == ESP_CPU_ATTENTION_BACKEND
        unregister_tree_attention()
        unregister_tree_attention()
        assert not backend.is_overridden()
    finally:
        backend.clear_override()


@pytest.mark.vllm
def test_a_vllm_without_the_backend_memo_gets_a_warning(monkeypatch):
    """``_forget_resolved_attention_backends`` reaches into a private vLLM
    memo (checked on 0.32.0). Where it is missing, the ESP worker warns and
    goes on (its start-up check still guards the model), instead of failing
    with an AttributeError."""
    from vllm.v1.attention import selector

    from vllm_esp.worker import _forget_resolved_attention_backends

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    # vLLM's loggers do not propagate to the root (pytest's caplog).
    handler = Collect(logging.WARNING)
    logger = logging.getLogger("vllm.esp")
    logger.addHandler(handler)
    try:
        monkeypatch.delattr(selector, "_cached_get_attn_backend")
        _forget_resolved_attention_backends()
    finally:
        logger.removeHandler(handler)
    assert any("_cached_get_attn_backend" in message for message in warnings)
