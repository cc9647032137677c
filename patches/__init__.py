# SPDX-License-Identifier: Apache-2.0
"""Patches for what vLLM offers no extension point for.

Installed as ``vllm_esp.patches``; see ``patches/README.md`` for the policy
and :mod:`vllm_esp.patching` for the registry every patch goes through.
"""
