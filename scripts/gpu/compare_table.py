"""Prints the table of `scripts/gpu/run.sh compare`: one line per kernel and case.

Reads lines "LABEL [words] JSON" (the JSON, from the first "{" on, is `mla bench --json`'s
last line) from the file named as the first argument.
"""
import json
import sys

for line in open(sys.argv[1]):
    kernel, text = line.split(" ", 1)[0], line[line.find("{") :]
    try:
        r = json.loads(text)
    except ValueError:
        print(f"{line.strip()[:60]}: failed")
        continue
    print(
        f"{kernel:6s} B={r['batch']:4d} H={r['heads']:4d} ctx={r['ctx']:6d} q={r['query_len']}"
        f"{'' if r['causal'] else 'n'}{' varlen' if r.get('varlen') else ''}"
        f"{' scheduled' if r.get('device_schedule') else ''} {r['kv_dtype']:5s}"
        f" {r['us']:9.1f} us {r['TFLOPs']:6.1f} TFLOP/s {r['TBps']:5.2f} TB/s"
        f" err {r['err_o']:.1e} lse {r['err_lse']:.1e} splits {r['num_kv_splits']}"
        f" {r.get('kernel', '')}"
    )
