#!/usr/bin/env bash
# Builds the mla_rs wheel (abi3, CPython 3.10+, manylinux_2_28) into DIR (default target/wheels),
# with maturin and zig (ziglang) from PyPI installed in a virtual environment under target/py:
# zig links against glibc 2.28, so the wheel installs wherever vLLM's own wheels do.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-target/wheels}
if ! target/py/bin/python -c "import maturin, ziglang" 2>/dev/null; then
  python3 -m venv target/py
  target/py/bin/pip install -q "maturin>=1.9,<2" "ziglang>=0.13,<0.15" pytest
fi
rm -f "$dest"/mla_rs-*.whl
PATH="$PWD/target/py/bin:$PATH" target/py/bin/maturin build -q --release --zig --compatibility manylinux_2_28 \
  -m crates/mla-py/Cargo.toml -o "$dest" >&2
ls "$dest"/mla_rs-*.whl
