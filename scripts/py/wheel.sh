#!/usr/bin/env bash
# Builds the mla_rs wheel (abi3, CPython 3.10+) into DIR (default target/wheels), with maturin
# from PyPI installed in a virtual environment under target/py.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-target/wheels}
if [ ! -x target/py/bin/maturin ]; then
  python3 -m venv target/py
  target/py/bin/pip install -q "maturin>=1.9,<2" pytest
fi
rm -f "$dest"/mla_rs-*.whl
target/py/bin/maturin build -q --release -m crates/mla-py/Cargo.toml -o "$dest" >&2
ls "$dest"/mla_rs-*.whl
