#!/usr/bin/env bash
# The CPU backend against PyTorch eager on the same math, with this machine's roofline, in
# one run (scripts/cpu/torch_baseline.py). Take it on an idle machine. Extra arguments go to
# the script (--iters N, --kernel portable|avx512-bf16|auto).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -q -p mla-cli
python=$(scripts/cpu/torch_venv.sh)
"$python" scripts/cpu/torch_baseline.py "$@"
