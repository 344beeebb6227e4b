#!/usr/bin/env bash
# PyTorch from PyPI in an ignored venv (target/torch-venv) for scripts/cpu/torch_baseline.py.
# Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/torch-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q torch numpy
fi
echo "$venv/bin/python"
