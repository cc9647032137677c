# SPDX-License-Identifier: Apache-2.0
"""vLLM general-plugin entry point (``vllm.general_plugins: esp``).

vLLM calls :func:`register` in every process it starts (front end, engine
core, each worker), before it builds configs or workers. It must stay cheap,
idempotent and inert: the only thing it installs is a pass-through wrapper
that recognises ``speculative_config={"method": "esp", ...}`` and turns it
into vLLM's own extension points (see :mod:`vllm_esp.patches.engine_args`).
Runs that do not ask for ESP go through vLLM unchanged.
"""

from __future__ import annotations

import logging

from vllm_esp.patching import installed_vllm_version, vllm_version_supported

# Under "vllm." so that vLLM's logging configuration (format, level,
# VLLM_LOGGING_LEVEL) applies to ESP's messages too.
logger = logging.getLogger("vllm.esp")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    version = installed_vllm_version()
    if not vllm_version_supported(version):
        # Do not break vLLM for users who installed us but do not use ESP;
        # the error is raised when ESP is requested.
        logger.debug("vllm-esp: vLLM %s is not supported; ESP disabled", version)
    from vllm_esp.patches import engine_args

    engine_args.apply()
