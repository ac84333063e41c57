#!/usr/bin/env bash
# The ZeroGPU stack, tested. ZeroGPU Spaces offer only Python 3.10.13 or 3.12.12 and torch 2.8.0, 2.9.1,
# 2.10.0 or 2.11.0; SkipKey is developed on Python 3.11 with torch 2.13. This makes a venv of one ZeroGPU
# pairing (.venv-zerogpu-pyX.Y/, git-ignored) with the rest of tests/requirements.txt, and runs the
# tiny-model suite in it: every test but those that load the embedded model or drive chromium.
#   bash .ci/zerogpu_stack.sh               # Python 3.12, torch 2.11.0
#   bash .ci/zerogpu_stack.sh 3.10 2.9.1    # Python 3.10, torch 2.9.1
# PyPI's torch for Linux x86_64 is the CUDA build, as on ZeroGPU (about 3.5 GB to download, 5.6 GB
# installed); here it runs on the CPU. The Python comes from PATH or pyenv (its newest X.Y.*).
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
torch_version=${2:-2.11.0}
venv=.venv-zerogpu-py$python_version

interpreter() {
    if "python$python_version" -V >/dev/null 2>&1; then
        command -v "python$python_version"
        return
    fi
    local found
    found=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/$python_version".*/bin/"python$python_version" \
        2>/dev/null | sort -V | tail -n 1)
    if [ -z "$found" ]; then
        echo "no Python $python_version on PATH or in pyenv: ZeroGPU's are 3.10 and 3.12" >&2
        exit 2
    fi
    echo "$found"
}

start=$(date +%s)
python=$(interpreter)
rm -rf "$venv"
"$python" -m venv "$venv"
nice -n 10 "$venv/bin/pip" install -q "torch==$torch_version" -r tests/requirements.txt
installed=$(date +%s)
"$venv/bin/python" -c 'import sys, torch, transformers, gradio
print(f"ZeroGPU stack: Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, gradio {gradio.__version__}")'
HF_HUB_OFFLINE=1 nice -n 10 "$venv/bin/python" -m pytest -q -m "not embedded and not browser"
echo "ZeroGPU stack: install $((installed - start)) s, tests $(($(date +%s) - installed)) s"
