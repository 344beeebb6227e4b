#!/usr/bin/env bash
# Builds, on a CPU machine, everything the GPU machine runs, into gpu-bin/ (ignored):
#   gpu-bin/mla            the CLI (release)
#   gpu-bin/mla-phases     the CLI with the CPU phase timer (feature cpu-phase-times)
#   gpu-bin/tests/<name>   the release test binaries that touch the GPU (run.sh runs each),
#                          and cpu_contract for the host CPU's amx-bf16 path (an Intel Xeon
#                          with AMX-BF16): MLA_REQUIRE_AMX=1 gpu-bin/tests/cpu_contract
#   gpu-bin/cache/         the sm_90a cubins
#   gpu-bin/wheels/        the mla_rs wheel (abi3, built by maturin from PyPI)
# and copies the side-by-side benchmark script next to the anchors if they were fetched
# (../shared/bench/fetch-anchors.sh .anchors). Then copy gpu-bin/ (and .anchors/) to the GPU
# machine's copy of the repository and run there: scripts/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

out=gpu-bin
rm -rf "$out"
mkdir -p "$out/tests"

# The CLI with decode context parallelism (NCCL is loaded at run time, only by --dcp).
cargo build --release -p mla-cli --features nccl
cp target/release/mla "$out/mla"
# The same CLI timing the CPU stage 1 by phase (the GPU machines' hosts, which have AMX, have no
# profiler): gpu-bin/mla-phases bench --backend cpu ... prints the phases.
cargo build --release -p mla-cli --features nccl,cpu-phase-times
cp target/release/mla "$out/mla-phases"

# The test binaries, by name (cargo prints their paths as JSON).
tests=(cuda_contract cuda_runtime cuda_batch_invariance cuda_sanitize cuda_schedule cuda_nan errors dcp_gpu cpu_contract)
cargo test --release -p mla --features nccl "${tests[@]/#/--test=}" --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil
want = set(sys.argv[2:])
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
        print("test binary:", m["target"]["name"])
' "$out/tests" "${tests[@]}"

# The sm_90a cubins, compiled here by NVRTC 13.0 from PyPI (scripts/ci/nvrtc.sh) into
# gpu-bin/cache under the names the GPU machine's NVRTC 13.0 gives them: run.sh seeds that
# machine's cache with them (a fresh machine spends a minute compiling otherwise), and a spill
# fails the build here.
LD_LIBRARY_PATH="$(scripts/ci/nvrtc.sh)" MLA_CACHE_DIR="$out/cache" "$out/mla" precompile --arch sm_90a \
  --deny-spills > "$out/precompile.txt"
tail -n 1 "$out/precompile.txt"

# The Python module, for its pytest suite and the in-process side-by-side benchmark.
scripts/py/wheel.sh "$out/wheels"

strip --strip-debug "$out/mla" "$out/mla-phases" "$out"/tests/* 2>/dev/null || true
if [ -d .anchors ] && [ -f ../shared/bench/anchors.py ]; then
  cp ../shared/bench/anchors.py .anchors/
fi
du -sh "$out" .anchors 2>/dev/null || du -sh "$out"
