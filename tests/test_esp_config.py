# SPDX-License-Identifier: Apache-2.0
"""Bad ESP options fail at start-up, before any engine or model is loaded,
with a message naming the key and the allowed values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_esp.config import ESPConfig, ESPConfigError


@pytest.mark.parametrize("options, must_mention", [
    ({"foo": 1}, ["'foo'", "num_mask_tokens", "block_complexity"]),
    ({"num_mask_tokens": 4}, ["num_mask_tokens", "1 to 3"]),
    ({"num_mask_tokens": 0}, ["num_mask_tokens", "1 to 3"]),
    ({"tree": [4, 4], "num_mask_tokens": 1}, ["'tree'", "1 positive int"]),
    ({"tree": [0]}, ["'tree'"]),
    ({"tree": "4"}, ["'tree'"]),
    ({"tree": [4], "block_complexity": 30}, ["'tree'", "'block_complexity'", "exclusive"]),
    ({"block_complexity": 3}, ["block_complexity", "4 to 129"]),
    ({"tree": [200]}, ["129"]),
    ({"mask_init": "random"}, ["mask_init", "mean | last | sample | zero"]),
    ({"ema": 1.5}, ["ema", "[0, 1]"]),
    ({"ema": "0.1"}, ["ema"]),
    ({"block_complexity": "big"}, ["block_complexity", "auto"]),
    ({"max_block_complexity": 200}, ["max_block_complexity", "4 to 129"]),
    ({"tree": [4], "max_block_complexity": 16}, ["max_block_complexity", "auto"]),
    ({"block_complexity": 20, "max_block_complexity": 16}, ["max_block_complexity"]),
    ({"tree": [4], "block_complexity": "auto"}, ["'tree'", "exclusive"]),
    ({"lookup_cache_tokens": -1}, ["lookup_cache_tokens", "0 to 65536"]),
    ({"lookup_cache_tokens": 10**6}, ["lookup_cache_tokens", "0 to 65536"]),
    ({"lookup_cache_tokens": True}, ["lookup_cache_tokens"]),
    ({"candidates": ["esp"], "lookup_cache_tokens": 100}, ["lookup_cache_tokens", "ngram"]),
    ({"sampling_verification": "walk"}, ["sampling_verification", '"tree" | "chain"']),
])
def test_bad_options_name_key_and_allowed_values(options, must_mention):
    with pytest.raises(ESPConfigError) as error:
        ESPConfig.from_dict(options)
    for text in must_mention:
        assert text in str(error.value)


def test_defaults_and_geometry():
    default = ESPConfig.from_dict({})
    # auto: blocks sized per step, up to 32 rows (vLLM reserves 31 slots).
    assert default.auto and default.tree is None
    assert (default.num_mask_tokens, default.block_size, default.num_draft_slots) == (1, 32, 31)
    assert default.candidates == ("esp", "ngram")
    assert ESPConfig.from_dict({"block_complexity": "auto"}) == default
    capped = ESPConfig.from_dict({"max_block_complexity": 16})
    assert capped.auto and capped.block_size == 16
    assert ESPConfig.from_dict({"tree": [4]}).block_size == 10
    assert ESPConfig.from_dict({"tree": [15, 4]}).num_draft_slots == 59
    dynamic = ESPConfig.from_dict({"block_complexity": 30})
    assert (dynamic.num_nodes, dynamic.node_budget, dynamic.block_size) == (15, 14, 30)
    two_masks = ESPConfig.from_dict({"num_mask_tokens": 2})
    assert two_masks.auto and two_masks.block_size == 30  # 10 nodes x 3 rows
    # Prompt lookup searches earlier answers too, unless turned off.
    assert default.lookup_cache_tokens == 8192
    assert ESPConfig.from_dict({"lookup_cache_tokens": 0}).lookup_cache_tokens == 0
    assert ESPConfig.from_dict({"candidates": ["esp"]}).lookup_cache_tokens == 0
    # Sampled trees are walked unless asked otherwise; the choice reaches
    # the workers.
    assert default.tree_sampling
    chain = ESPConfig.from_dict({"sampling_verification": "chain"})
    assert not chain.tree_sampling
    assert ESPConfig.from_serialized(chain.to_dict()) == chain


def _engine_args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model="unused", **kwargs)


def test_translation_to_vllm_hooks():
    from vllm_esp.patches.engine_args import translate_esp_engine_args

    args = _engine_args(speculative_config={"method": "esp", "tree": [15, 4]},
                        additional_config={"other": 1})
    config = translate_esp_engine_args(args, "cpu")
    assert args.speculative_config == {
        "method": "custom_class", "model": "vllm_esp.proposer.ESPProposer",
        "num_speculative_tokens": 59}
    assert args.additional_config == {"other": 1, "esp": config.to_dict()}
    assert args.worker_cls == "vllm_esp.worker.ESPCPUWorker"
    assert args.scheduler_cls == "vllm_esp.scheduler.ESPScheduler"
    # What clients may send is the user's choice, not ESP's.
    assert args.enable_prompt_embeds is False
    trusted = _engine_args(speculative_config={"method": "esp"}, enable_prompt_embeds=True)
    translate_esp_engine_args(trusted, "cpu")
    assert trusted.enable_prompt_embeds is True


@pytest.mark.parametrize("kwargs, must_mention", [
    (dict(pipeline_parallel_size=2), ["pipeline_parallel_size", "Allowed: pipeline_parallel_size=1"]),
    (dict(worker_cls="my.Worker"), ["worker_cls", "'auto'"]),
    (dict(enable_lora=True), ["enable_lora", "Allowed: enable_lora=False"]),
])
def test_unservable_combinations_refused(kwargs, must_mention):
    from vllm_esp.patches.engine_args import translate_esp_engine_args

    args = _engine_args(speculative_config={"method": "esp"}, **kwargs)
    with pytest.raises(ESPConfigError) as error:
        translate_esp_engine_args(args, "cpu")
    for text in must_mention:
        assert text in str(error.value)


def test_num_speculative_tokens_must_match_block():
    from vllm_esp.patches.engine_args import translate_esp_engine_args

    ok = _engine_args(speculative_config={"method": "esp", "num_speculative_tokens": 31})
    translate_esp_engine_args(ok, "cpu")
    bad = _engine_args(speculative_config={"method": "esp", "num_speculative_tokens": 5})
    with pytest.raises(ESPConfigError, match="num_speculative_tokens"):
        translate_esp_engine_args(bad, "cpu")


def test_llm_refuses_bad_config_before_loading_anything():
    """Through the public LLM API, in a fresh process with the plugin loaded
    by vLLM's entry point: the error comes from config creation."""
    code = (
        "from vllm import LLM\n"
        "try:\n"
        "    LLM(model='/nonexistent-model', speculative_config="
        "{'method': 'esp', 'tree': [4], 'mask_init': 'bogus'})\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=300)
    assert "ERR ESP speculative_config: invalid value for 'mask_init'" in result.stdout, \
        result.stdout + result.stderr[-3000:]


def test_vllm_serve_refuses_bad_config_at_startup():
    import shutil

    vllm_cli = shutil.which("vllm") or str(__import__("pathlib").Path(sys.executable).parent / "vllm")
    result = subprocess.run(
        [vllm_cli, "serve", "/nonexistent-model", "--speculative-config",
         '{"method": "esp", "num_mask_tokens": 7}'],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "invalid value for 'num_mask_tokens': 7. Allowed: an int from 1 to 3" in (
        result.stdout + result.stderr), result.stderr[-3000:]


@pytest.mark.parametrize("options", [{}, {"tree": [15, 4]}, {"block_complexity": 30},
                                     {"num_mask_tokens": 2, "block_complexity": 20,
                                      "mask_init": "zero", "ema": 0.0},
                                     {"lookup_cache_tokens": 100}])
def test_serialized_round_trip(options):
    """Workers rebuild the config from additional_config["esp"]."""
    config = ESPConfig.from_dict(options)
    assert ESPConfig.from_serialized(config.to_dict()) == config


def test_gpu_platform_refused_until_implemented():
    from vllm_esp.patches.engine_args import translate_esp_engine_args

    args = _engine_args(speculative_config={"method": "esp"})
    with pytest.raises(ESPConfigError, match="CPU backend only"):
        translate_esp_engine_args(args, "gpu")
