#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool), from the repository root, with gpu-bin/
# (scripts/gpu/build.sh) and optionally .anchors/ carried. Writes every log into $OUT (the
# folder that comes back), or ./results when $OUT is unset. The last lines printed are a
# summary.
#   scripts/gpu/run.sh [all|tests|try|memcheck|racecheck|pytest|bench|compare|narrow|schedule|cases|pdl|sweep|ablate|profile|dcp|mtp|fp8q|anchors] ...
# `ablate` times the wgmma kernel with parts switched off (MLA_EXTRA_DEFINES, see
# kernels/decode_wgmma/NOTES.md); `dcp` runs the two-GPU DCP test and `mla bench --dcp 2`
# (needs two GPUs).
# `tests` runs the GPU suites with the kernels chosen as shipped, then the contract and
# runtime suites again with MLA_KERNEL=wgmma (the Hopper kernel at every head count),
# MLA_KERNEL=mma (the sm_80 kernel at every head count), MLA_KERNEL=narrow (Hopper's
# few-head kernel for single tokens too) and MLA_KERNEL=seesaw (the seesaw kernel for every
# single-token decode with a cache in the model dtype). `compare` times the stage-1 kernels
# of MLA_COMPARE_KERNELS (default: mma wgmma) on the same cases.
# Each step runs under a time limit (seconds, env: MLA_STEP_LIMIT, default 300).
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${OUT:-results}
out=$(mktemp -d)  # the logs, packed into $final/logs.tgz at the end (the device tool returns few files)
mkdir -p "$final"
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
# The sm_90a cubins build.sh compiled here (same NVRTC 13.0, same cache names): a fresh
# machine then loads them instead of spending a minute compiling.
if [ -d gpu-bin/cache ]; then mkdir -p "$MLA_CACHE_DIR" && cp -rn gpu-bin/cache/. "$MLA_CACHE_DIR"/; fi
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

# run_test NAME KERNEL [DEFINES]: one test binary with MLA_KERNEL=KERNEL (empty: as shipped)
# and MLA_EXTRA_DEFINES=DEFINES.
run_test() {
  local t=$1 kernel=$2 defs=${3:-} log="$out/test-$1${2:+-$2}${3:+-try}${MLA_SCHEDULE:+-scheduled}.log" start rc
  start=$(date +%s)
  # A trial gets a short limit: it may hang.
  local lim=$limit
  [ -n "$defs" ] && lim=${MLA_TRY_LIMIT:-40}
  MLA_KERNEL=$kernel MLA_EXTRA_DEFINES=$defs timeout "$lim" \
    gpu-bin/tests/$t --nocapture > "$log" 2>&1
  rc=$?
  note "tests $t${kernel:+ (MLA_KERNEL=$kernel)}${MLA_SCHEDULE:+ (MLA_SCHEDULE=$MLA_SCHEDULE)}${defs:+ ($defs)}: rc=$rc ($(( $(date +%s) - start ))s): $(grep -E '^test result' "$log" | tail -n 1)"
  if [ $rc -ne 0 ]; then
    grep -E -B2 -A12 "panicked|^---- " "$log" | cut -c1-400 | head -n 60
    [ -n "$defs" ] && try_failed=1
  fi
}
try_failed=0
if has tests; then
  for t in cuda_contract cuda_runtime cuda_sanitize cuda_schedule; do run_test $t ""; done
  for k in wgmma mma narrow seesaw wgmma_fp8; do
    for t in cuda_contract cuda_runtime; do run_test $t $k; done
  done
  # The device-computed schedule (docs/scheduler.md) on the kernels that take it.
  export MLA_SCHEDULE=1
  for k in wgmma mma seesaw; do
    for t in cuda_contract cuda_runtime; do run_test $t $k; done
  done
  unset MLA_SCHEDULE

  # The Hopper kernel must be built of warpgroup MMAs (HGMMA in the SASS).
  for f in $(find "$MLA_CACHE_DIR" -type f); do
    n=$(cuobjdump -sass "$f" 2>/dev/null | grep -c HGMMA)
    [ "${n:-0}" -gt 0 ] && echo "$(basename "$f"): $n HGMMA" >> "$out/sass.txt"
  done
  note "sass: $(wc -l < "$out/sass.txt" 2>/dev/null || echo 0) cubins with HGMMA"
fi

# A kernel variant under trial (MLA_TRY_DEFINES: the -D defines that switch it on), on the
# family MLA_TRY_KERNEL forces (default wgmma; e.g. seesaw): its tests, each under
# MLA_TRY_LIMIT seconds (default 40: a trial may hang). Only a trial whose tests passed
# (try_ok) joins the sanitizer and ablate steps (`run.sh try memcheck racecheck ablate`).
try_kernel=${MLA_TRY_KERNEL:-wgmma}
try_ok=0
if [[ " $steps " == *" try "* ]] && [ -n "${MLA_TRY_DEFINES:-}" ]; then
  for t in cuda_contract cuda_runtime cuda_sanitize; do run_test $t "$try_kernel" "$MLA_TRY_DEFINES"; done
  [ "$try_failed" = 0 ] && try_ok=1
fi

# Each sanitizer six ways: kernels as shipped, the wgmma kernel at every head count, the
# narrow and the seesaw kernels wherever they run, and the scheduled decode on the wgmma and
# the mma kernels (and a trial variant). The runs are independent and mostly CPU-bound (instrumentation), so
# they run side by side (MLA_SANITIZE_SERIAL=1: one at a time); each writes its summary line
# to a file, read back in order.
sanitize_one() {  # TOOL K: one run, its summary line into $out/note-sanitizer-TOOL-K.txt
  local tool=$1 k=$2 defs="" kernel=$2 sched=0 lim=$limit rc
  if [ "$k" = try ]; then defs=$MLA_TRY_DEFINES; kernel=$try_kernel; lim=${MLA_TRY_LIMIT:-40}; fi
  if [[ "$k" == scheduled-* ]]; then kernel=${k#scheduled-}; sched=1; fi
  local log="$out/sanitizer-$tool${k:+-$k}.log"
  MLA_SCHEDULE=$sched MLA_KERNEL=$kernel MLA_EXTRA_DEFINES=$defs timeout "$lim" compute-sanitizer --tool "$tool" \
    --error-exitcode 9 gpu-bin/tests/cuda_sanitize --test-threads=1 > "$log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool${k:+ (MLA_KERNEL=$kernel MLA_SCHEDULE=$sched $defs)}: rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$log" | tr '\n' ' ')" \
    > "$out/note-sanitizer-$tool-${k:-shipped}.txt"
}
runs=()
for tool in memcheck racecheck; do
  if has "$tool"; then
    trial=""
    [ "$try_ok" = 1 ] && trial=try
    for k in "" wgmma narrow seesaw wgmma_fp8 scheduled-wgmma scheduled-mma scheduled-seesaw $trial; do runs+=("$tool:$k"); done
  fi
done
for r in "${runs[@]}"; do
  if [ "${MLA_SANITIZE_SERIAL:-0}" = 1 ]; then sanitize_one "${r%%:*}" "${r#*:}"; else sanitize_one "${r%%:*}" "${r#*:}" & fi
done
wait
for r in "${runs[@]}"; do
  k=${r#*:}
  note "$(cat "$out/note-sanitizer-${r%%:*}-${k:-shipped}.txt" 2>/dev/null || echo "compute-sanitizer $r: no result")"
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

# bench_row LABEL KERNEL DEFINES LOG BENCH-ARGS...: one `mla bench --json` case on the GPU with
# MLA_KERNEL=KERNEL and MLA_EXTRA_DEFINES=DEFINES, appended to $out/LOG.txt as "LABEL JSON"
# (the line compare_table.py reads); stderr to $out/LOG.err.
bench_row() {
  local label=$1 kernel=$2 defs=$3 log=$4 r
  shift 4
  r=$(MLA_KERNEL=$kernel MLA_EXTRA_DEFINES=$defs timeout "$limit" gpu-bin/mla bench --backend cuda \
    --page 64 --iters 10 --json "$@" 2>> "$out/$log.err" | tail -n 1)
  echo "$label $r" >> "$out/$log.txt"
}

if has compare; then
  # batch heads ctx kv-dtype [more bench arguments]: the stage-1 kernels of
  # MLA_COMPARE_KERNELS on the same problems, those below or MLA_COMPARE_CASES ("b h ctx kv
  # [more bench arguments]; ...").
  compare_cases() {
    if [ -n "${MLA_COMPARE_CASES:-}" ]; then tr ';' '\n' <<< "$MLA_COMPARE_CASES"; else cat; fi
  }
  while read -r b h c kv extra; do
    [ -n "$b" ] || continue
    for k in ${MLA_COMPARE_KERNELS:-mma wgmma}; do
      bench_row "$k $b $h $c $kv" "$k" "" compare --batch "$b" --heads "$h" --ctx "$c" \
        --kv-dtype "$kv" $extra
    done
  done < <(compare_cases <<'CASES'
128 128 4096 bf16
32 128 8192 bf16
1 128 8192 bf16
64 64 4096 bf16
128 16 4096 bf16
128 128 4096 fp8
1 128 8192 fp8
64 32 4096 bf16
64 32 4096 fp8
64 128 4096 bf16 --query-len 2
64 16 8192 bf16 --query-len 4 --causal false
64 16 8192 bf16 --query-len 4
64 16 8192 bf16 --query-len 2
4 16 8192 bf16 --query-len 4
64 16 8192 fp8 --query-len 4
CASES
)
  python3 scripts/gpu/compare_table.py "$out/compare.txt"
fi

if has narrow; then
  # Few heads: the narrow kernel (forced with MLA_KERNEL=narrow; as shipped it runs the
  # multi-token rows of up to 8 heads) against the mma kernel, on the same problems.
  while read -r b h c kv extra; do
    for k in narrow mma; do
      bench_row "$k $b $h $c $kv" "$k" "" narrow --batch "$b" --heads "$h" --ctx "$c" \
        --kv-dtype "$kv" $extra
    done
    # A variant of the narrow kernel under trial (MLA_TRY_DEFINES).
    if [ -n "${MLA_TRY_DEFINES:-}" ]; then
      bench_row "try $b $h $c $kv" narrow "$MLA_TRY_DEFINES" narrow --batch "$b" --heads "$h" \
        --ctx "$c" --kv-dtype "$kv" $extra
    fi
  done <<'CASES'
128 16 4096 bf16
64 16 8192 bf16
32 16 8192 bf16
8 16 4096 bf16
4 16 32768 bf16
1 16 8192 bf16
1 16 1024 bf16
128 8 4096 bf16
64 8 8192 bf16 --query-len 2
128 16 4096 fp8
64 16 8192 fp8
8 16 4096 fp8
64 8 8192 fp8 --query-len 2
CASES
  python3 scripts/gpu/compare_table.py "$out/narrow.txt"
fi

if has schedule; then
  # The device-computed schedule (MLA_SCHEDULE=1) against the fill rule's split grid, on the
  # same problems (varied lengths are what it is for).
  while read -r b h c kv extra; do
    for s in 0 1; do
      MLA_SCHEDULE=$s bench_row "schedule=$s $b $h $c $kv" "" "" schedule --batch "$b" \
        --heads "$h" --ctx "$c" --kv-dtype "$kv" $extra
    done
  done <<'CASES'
64 128 8192 bf16 --varlen
64 16 8192 bf16 --varlen
32 128 8192 bf16 --varlen
128 128 4096 bf16
32 128 4096 bf16
4 128 32768 bf16
8 128 4096 bf16
1 128 8192 bf16
128 16 4096 bf16
64 16 8192 bf16
8 16 4096 bf16
1 16 8192 bf16
64 128 8192 fp8 --varlen
CASES
  python3 scripts/gpu/compare_table.py "$out/schedule.txt"
fi

if has cases; then
  # Chosen cases as shipped (MLA_CASES: "b h ctx kv [more bench arguments]; ..."; --schedule
  # is one of the bench arguments).
  IFS=';' read -ra cases <<< "${MLA_CASES:-64 16 8192 fp8; 64 16 8192 bf16; 128 128 2048 fp8; 128 128 2048 bf16}"
  for c in "${cases[@]}"; do
    read -r b h ctx kv extra <<< "$c"
    bench_row "ours $b $h $ctx $kv" "" "" cases --batch "$b" --heads "$h" --ctx "$ctx" \
      --kv-dtype "$kv" $extra
  done
  python3 scripts/gpu/compare_table.py "$out/cases.txt"
fi

if has pdl; then
  # The combine as a programmatic dependent launch (as shipped on sm_90a) against an ordinary
  # launch (MLA_EXP_NO_PDL=1), on the small batches where its launch and latency show.
  while read -r b h c kv; do
    bench_row "pdl $b $h $c $kv" "" "" pdl --batch "$b" --heads "$h" --ctx "$c" --kv-dtype "$kv"
    MLA_EXP_NO_PDL=1 bench_row "nopdl $b $h $c $kv" "" "" pdl --batch "$b" --heads "$h" --ctx "$c" \
      --kv-dtype "$kv"
  done <<'CASES'
1 16 8192 bf16
1 16 1024 bf16
1 128 8192 bf16
1 128 1024 bf16
8 128 4096 bf16
4 16 32768 bf16
CASES
  python3 scripts/gpu/compare_table.py "$out/pdl.txt"
fi

if has sweep; then
  # Split counts against the fill rule's choice (`mla bench --splits`), on the small batches
  # the rule decides: what a retuned rule (or the GPU scheduler) could gain. MLA_SWEEP_CASES
  # ("b h ctx kv [more bench arguments, e.g. --varlen]; ..."), MLA_SWEEP_SPLITS replace the
  # defaults; MLA_SWEEP_SCHEDULE=1 adds a row on the device-computed schedule (--schedule).
  default_cases="1 128 8192 bf16; 1 128 1024 bf16; 1 16 8192 bf16; 8 128 4096 bf16; 4 16 32768 bf16"
  IFS=';' read -r -a sweep_cases <<< "${MLA_SWEEP_CASES:-$default_cases}"
  for case in "${sweep_cases[@]}"; do
    read -r b h c kv extra <<< "$case"
    # shellcheck disable=SC2086  # extra is a list of arguments
    set -- --batch "$b" --heads "$h" --ctx "$c" --kv-dtype "$kv" $extra
    bench_row "rule $case" "" "" sweep "$@"
    for n in ${MLA_SWEEP_SPLITS:-8 16 32 48 64 96 128}; do
      bench_row "splits=$n $case" "" "" sweep "$@" --splits "$n"
    done
    [ "${MLA_SWEEP_SCHEDULE:-0}" = 1 ] && bench_row "schedule $case" "" "" sweep "$@" --schedule
  done
  python3 scripts/gpu/compare_table.py "$out/sweep.txt"
fi

if has ablate; then
  # The wgmma kernel with one part switched off at a time, on two problems.
  # MLA_ABLATE_DEFINES (comma-separated) replaces the switches; a trial whose tests failed
  # is left out (it may hang).
  IFS=, read -r -a sets <<< "${MLA_ABLATE_DEFINES-,-DMLA_EXP_NO_S,-DMLA_EXP_NO_PV,-DMLA_EXP_NO_LOAD,-DMLA_EXP_L2_LOAD}"
  [ "$try_ok" = 1 ] && sets+=("$MLA_TRY_DEFINES")
  for defs in "${sets[@]}"; do
    for shape in "64 64" "128 128" "1 128" "32 128"; do
      set -- $shape
      bench_row "${defs:-base} $1 $2 4096 bf16" wgmma "$defs" ablate --batch "$1" --heads "$2" \
        --ctx 4096 --kv-dtype bf16
    done
  done
  python3 scripts/gpu/compare_table.py "$out/ablate.txt"
fi

if has dcp; then
  n=$(nvidia-smi -L | wc -l)
  if [ "$n" -ge 2 ]; then
    timeout "$limit" gpu-bin/tests/dcp_gpu --test-threads=1 --nocapture > "$out/test-dcp_gpu.log" 2>&1
    note "tests dcp_gpu: rc=$?: $(grep -E '^test result' "$out/test-dcp_gpu.log" | tail -n 1)"
    grep -E "o_rel|lse" "$out/test-dcp_gpu.log" | head -n 12
    for args in "--batch 64 --ctx 131072 --heads 128" "--batch 8 --ctx 524288 --heads 16"; do
      timeout "$limit" gpu-bin/mla bench --dcp 2 $args --iters 10 >> "$out/dcp-bench.txt" 2>&1
      note "dcp bench $args: rc=$?"
    done
    cat "$out/dcp-bench.txt"
  else
    note "dcp: skipped, $n GPU(s)"
  fi
fi

if has profile; then
  # Nsight Compute on one decode: by default the wgmma kernel on 64 requests x 4096 keys, 64
  # heads (one wave). MLA_PROFILE_KERNEL (a regex of entry points, e.g.
  # "mla_decode_(narrow|combine)"), MLA_PROFILE_COUNT (launches profiled), MLA_PROFILE_CHOICE
  # (MLA_KERNEL) and MLA_PROFILE_ARGS (`mla bench` arguments) replace the defaults.
  # shellcheck disable=SC2086  # MLA_PROFILE_ARGS is a list of arguments
  timeout "$limit" ncu --clock-control none --kernel-name "regex:${MLA_PROFILE_KERNEL:-mla_decode_wgmma}" \
    --launch-count "${MLA_PROFILE_COUNT:-1}" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    env MLA_KERNEL="${MLA_PROFILE_CHOICE:-wgmma}" gpu-bin/mla bench --backend cuda \
    ${MLA_PROFILE_ARGS:---batch 64 --heads 64 --ctx 4096} --page 64 --kv-dtype bf16 --iters 1 \
    > "$out/ncu.txt" 2>&1
  note "profile: rc=$? (ncu.txt)"
  grep -E "Duration|Throughput|Pipe|Stall|Issued|Eligible|Active Warps|L2 Hit|Registers|Shared Memory Config" "$out/ncu.txt" | head -n 40
fi

if has mtp && [ -f .anchors/anchors.py ]; then
  # Multi-token (causal, 2 and 4 tokens a request) side by side with FlashMLA and FA3.
  PYTHONUNBUFFERED=1 timeout "$limit" python3 scripts/gpu/anchors_mtp.py --ref .anchors \
    --out "$out/anchors-mtp.json" > "$out/anchors-mtp.txt" 2>&1
  note "anchors mtp: rc=$? (anchors-mtp.txt)"
  tail -n 20 "$out/anchors-mtp.txt"
  cp "$out/anchors-mtp.json" "$final/" 2>/dev/null
fi

if has fp8q && [ -f .anchors/anchors.py ]; then
  # fp8 caches: FlashMLA's fp8 path against ours with a bf16 query and in the fp8-query mode.
  PYTHONUNBUFFERED=1 timeout "$limit" python3 scripts/gpu/anchors_fp8q.py --ref .anchors \
    --out "$out/anchors-fp8q.json" > "$out/anchors-fp8q.txt" 2>&1
  note "anchors fp8q: rc=$? (anchors-fp8q.txt)"
  tail -n 24 "$out/anchors-fp8q.txt"
  cp "$out/anchors-fp8q.json" "$final/" 2>/dev/null
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
