#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Optional: install arctic-inference, which vLLM's "suffix" speculative method
# needs (vllm/v1/spec_decode/suffix_decoding.py imports
# arctic_inference.suffix_decoding.SuffixDecodingCache). Not a dependency of
# vllm-esp; the benchmark skips the "suffix" method with a notice without it.
#
#   bash benchmarks/install_suffix.sh            # into .venv (or $ESP_VENV)
#
# arctic-inference 0.3.0 is an sdist: a small C++ extension (nanobind) built
# with CMake, ~2-3 minutes on 2 cores. Two things make it build here:
#  * its build requirements list "torch>=2.10.0"; in pip's isolated build
#    environment that resolves to the newest CUDA torch (GBs of downloads).
#    A *build* constraint pins it to the torch already installed (pip >= 25.3
#    reads PIP_BUILD_CONSTRAINT; PIP_CONSTRAINT does not reach build envs).
#  * CMake's FindPython may pick a system python3 without headers
#    ("Could NOT find Python (missing: Python_INCLUDE_DIRS ...)"), so the
#    venv's interpreter is passed explicitly.
# --no-deps: it declares none at run time; this keeps pip from touching vLLM.
# Its vLLM plugin stays inactive unless ARCTIC_INFERENCE_ENABLED=1 (we never
# set it), so installing it changes nothing else.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ESP_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

if "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  echo "[suffix] arctic-inference already installed"
  exit 0
fi
PIN="$(mktemp)"
trap 'rm -f "$PIN"' EXIT
"$PY" -c "import torch; print('torch==' + torch.__version__)" > "$PIN"
echo "[suffix] building arctic-inference 0.3.0 against $(cat "$PIN") (a few minutes)"
PIP_BUILD_CONSTRAINT="$PIN" PIP_CONSTRAINT="$PIN" \
  CMAKE_ARGS="-DPython_EXECUTABLE=$PY ${CMAKE_ARGS:-}" \
  "$PY" -m pip install --no-deps "arctic-inference==0.3.0"
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('[suffix] import ok')"
