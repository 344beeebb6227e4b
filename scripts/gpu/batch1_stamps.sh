#!/usr/bin/env bash
# Where a small decode's time goes (GPU machine; carry gpu-bin). For each case of
# MLA_B1_CASES ("B H CTX; ...", bf16, pages of 64): `mla bench` as built, then with
# MLA_EXP_EMPTY (the stage-1 kernel returns at once: the launches' cost alone, results wrong),
# then one run with MLA_EXP_STAMPS, whose stage-1 CTAs (blockIdx.x 0; blockIdx.y first and
# last) print the SM clock at their phases (common/ptx.cuh, Stamps; the points are marked in
# decode_mma and decode_wgmma: 1 keys known, 2 offsets and q issued, 3 first tiles issued,
# 4 tile 0 landed, 5 tile 0's P in shared memory, 6 tile 0 done, 7 last tile done, 8 stored;
# in the combine: 1 stage 1's writes visible, 2 done). Stage 1's printf delays its end, so
# a stamped combine's wait (point 1) is not the real one; the rest of its points are.
# MLA_B1_DEFINES ("DEFINES; DEFINES; ..."; an empty item is the build as it is) replaces the
# two timed runs (default "; -DMLA_EXP_EMPTY"), e.g. the combine's switches
# (kernels/combine/kernel.cu): "; -DMLA_EXP_COMBINE=1; -DMLA_EXP_COMBINE=2". MLA_B1_STAMPS
# replaces the stamped run's defines (default -DMLA_EXP_STAMPS; e.g. add
# -DMLA_EXP_COMBINE_REPS=3, whose combine stamps points 2 .. 4 at the end of each merge).
set -uo pipefail
cd "$(dirname "$0")/../.."
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
if [ -d gpu-bin/cache ]; then mkdir -p "$MLA_CACHE_DIR" && cp -rn gpu-bin/cache/. "$MLA_CACHE_DIR"/; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
IFS=';' read -ra cases <<< "${MLA_B1_CASES:-1 16 64; 1 16 1024; 1 16 8192; 1 128 64; 1 128 1024; 1 128 8192; 8 16 4096; 8 128 4096}"
for c in "${cases[@]}"; do
  read -r b h ctx <<< "$c"
  line="$b x $h x $ctx:"
  IFS=';' read -ra variants <<< "${MLA_B1_DEFINES:-; -DMLA_EXP_EMPTY}"
  for defs in "${variants[@]}"; do
    read -r defs <<< "$defs"  # trimmed
    r=$(MLA_EXTRA_DEFINES=$defs timeout 60 gpu-bin/mla bench --backend cuda --batch "$b" --heads "$h" --ctx "$ctx" \
      --page 64 --iters 10 --json 2>/dev/null | tail -n 1)
    line="$line ${defs:-as built} $(echo "$r" | python3 -c 'import json, sys
r = json.load(sys.stdin)
print("%.1f us (splits %d)" % (r["us"], r["num_kv_splits"]))' 2>/dev/null || echo failed);"
  done
  echo "$line"
  MLA_EXTRA_DEFINES=${MLA_B1_STAMPS:--DMLA_EXP_STAMPS} timeout 60 gpu-bin/mla bench --backend cuda --batch "$b" --heads "$h" \
    --ctx "$ctx" --page 64 --iters 1 2>/dev/null | grep mla-stamps | tail -n 6
done
