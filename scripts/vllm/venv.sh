#!/usr/bin/env bash
# Installs vLLM 0.33.0 (CPU-only use: import, registry, selector, metadata dataclasses) with torch
# and pytest from PyPI into a cached virtual environment and prints its folder. The environment is
# about 10 GB and takes minutes to build once; later calls reuse it. MLA_VLLM_VENV overrides the
# folder (default target/vllm-0.33.0, ignored by git).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=0.33.0
venv=${MLA_VLLM_VENV:-target/vllm-$version}
stamp="$venv/.installed-$version"
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q "vllm==$version" pytest >&2
  touch "$stamp"
fi
case "$venv" in /*) echo "$venv" ;; *) echo "$PWD/$venv" ;; esac
