#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool), from the repository root, with gpu-bin/
# (scripts/gpu/build.sh) and optionally .anchors/ carried. Writes every log into $OUT (the
# folder that comes back), or ./results when $OUT is unset. The last lines printed are a
# summary.
#   scripts/gpu/run.sh [all|tests|memcheck|racecheck|pytest|bench|anchors] ...
# Each step runs under a time limit (seconds, env: MLA_STEP_LIMIT, default 300).
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${OUT:-results}
out=$(mktemp -d)  # the logs, packed into $final/logs.tgz at the end (the device tool returns few files)
mkdir -p "$final"
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
export RUST_BACKTRACE=1
steps=${*:-all}
summary=()
note() { summary+=("$1"); }

has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
limit=${MLA_STEP_LIMIT:-300}

# mla_rs, when its wheel was built: the anchors benchmark then runs it in-process.
if ls gpu-bin/wheels/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/mla-site gpu-bin/wheels/*.whl \
    && export PYTHONPATH=/tmp/mla-site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$out/gpu.txt" 2>&1
gpu-bin/mla info > "$out/info.txt" 2>&1
gpu-bin/mla precompile > "$out/precompile.txt" 2>&1
note "precompile: $(tail -n 1 "$out/precompile.txt")"

if has tests; then
  for t in cuda_contract cuda_runtime cuda_sanitize; do
    start=$(date +%s)
    timeout "$limit" gpu-bin/tests/$t > "$out/test-$t.log" 2>&1
    rc=$?
    note "tests $t: rc=$rc ($(( $(date +%s) - start ))s): $(grep -E '^test result' "$out/test-$t.log" | tail -n 1)"
    if [ $rc -ne 0 ]; then
      grep -E -B2 -A12 "panicked|^---- " "$out/test-$t.log" | cut -c1-400 | head -n 60
    fi
  done
fi

for tool in memcheck racecheck; do
  if has "$tool"; then
    timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 gpu-bin/tests/cuda_sanitize \
      --test-threads=1 > "$out/sanitizer-$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool: rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$out/sanitizer-$tool.log" | tr '\n' ' ')"
  fi
done

if has pytest; then
  timeout "$limit" python3 -m pytest -q -rs crates/mla-py/tests > "$out/pytest.log" 2>&1
  rc=$?
  note "pytest: rc=$rc: $(tail -n 1 "$out/pytest.log")"
  if [ $rc -ne 0 ]; then grep -E -A25 "^_+ test" "$out/pytest.log" | cut -c1-300 | head -n 80; fi
fi

if has bench; then
  timeout "$limit" gpu-bin/mla bench --backend cuda --iters 10 > "$out/bench.txt" 2>&1
  note "bench: rc=$? (bench.txt)"
fi

if has anchors && [ -f .anchors/anchors.py ]; then
  PYTHONUNBUFFERED=1 timeout "$limit" python3 .anchors/anchors.py --ref .anchors --out "$out/anchors.json" \
    --ours "gpu-bin/mla bench --backend cuda --iters 10" > "$out/anchors.txt" 2>&1
  note "anchors: rc=$? (anchors.txt)"
  tail -n 8 "$out/anchors.txt"
fi

tar czf "$final/logs.tgz" -C "$out" .
[ -f "$out/anchors.json" ] && cp "$out/anchors.json" "$final/"
echo
printf '%s\n' "${summary[@]}"
