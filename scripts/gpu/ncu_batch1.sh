#!/usr/bin/env bash
# Nsight Compute on batch-1 decodes (GPU machine, with gpu-bin): for each case, the kernel's
# duration, warp-state stalls and per-SASS-instruction counts, written to the results folder
# (ncu_setup.sh) as ncu.tgz: the reports, their details pages and the per-instruction CSVs.
#   scripts/gpu/ncu_batch1.sh ["KERNEL_REGEX bench-args; ..."]
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/ncu_setup.sh
. scripts/gpu/ncu_setup.sh
IFS=';' read -ra cases <<< "${1:-mla_decode_split --heads 16 --ctx 64; mla_decode_wgmma --heads 128 --ctx 64; mla_decode_combine --heads 16 --ctx 8192; mla_decode_split --heads 16 --ctx 8192}"
i=0
for c in "${cases[@]}"; do
  read -r kname args <<< "$c"
  i=$((i + 1))
  # shellcheck disable=SC2086  # args is a list of arguments
  timeout 120 ncu --clock-control none --cache-control none --kernel-name "regex:$kname" \
    --launch-skip 3 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section LaunchStats --section SpeedOfLight \
    --import-source no -o "$out/r$i" gpu-bin/mla bench --backend cuda --batch 1 $args --page 64 \
    --iters 1 > "$out/r$i.log" 2>&1
  echo "== $i $kname $args rc=$?"
  ncu -i "$out/r$i.ncu-rep" --page details > "$out/r$i.txt" 2>&1
  grep -E "Duration|Warp Cycles Per Issued" "$out/r$i.txt" | head -n 4
  ncu -i "$out/r$i.ncu-rep" --page source --print-source sass --csv > "$out/r$i.sass.csv" 2>&1
  ncu -i "$out/r$i.ncu-rep" --page raw --csv > "$out/r$i.raw.csv" 2>&1
done
tar czf "$final/ncu.tgz" -C "$out" .
