# SPDX-License-Identifier: Apache-2.0
"""The core package and the reference decoder must not import vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_core_and_reference_do_not_import_vllm():
    code = ("import sys, vllm_esp.core, vllm_esp_dev.reference; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
