"""The seesaw kernel's trace (MLA_EXTRA_DEFINES=-DMLA_EXP_TRACE, kernels/decode_seesaw/kernel.cu,
`trace`) as a table: for each traced step, its length and each warpgroup's 8 points in SM
cycles from the step's start (warpgroup 0's point 0). Reads the `mla-trace` lines of one
launch from stdin, e.g.
  MLA_KERNEL=seesaw MLA_EXTRA_DEFINES=-DMLA_EXP_TRACE gpu-bin/mla bench --backend cuda \\
    --batch 66 --heads 128 --ctx 4096 --iters 1 | grep mla-trace | tail -n 16 | python3 scripts/gpu/seesaw_trace.py
"""
import re
import sys

points = {}
for line in sys.stdin:
    m = re.match(r"mla-trace wg (\d) step (\d+): (.*)", line.strip())
    if m:
        points[(int(m.group(1)), int(m.group(2)))] = [int(v) for v in m.group(3).split()]
steps = sorted({s for _, s in points})
for s in steps:
    if (0, s) not in points or (1, s) not in points:
        continue
    start = points[(0, s)][0]
    length = points[(0, s + 1)][0] - start if (0, s + 1) in points else None
    print(f"step {s}" + (f": {length} cycles" if length is not None else ""))
    for wg in (0, 1):
        # The clock is 32 bits: differences wrap.
        print(f"  warpgroup {wg}:", " ".join(f"{(v - start) % (1 << 32):6d}" for v in points[(wg, s)]))
