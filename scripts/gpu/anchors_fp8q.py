"""fp8 caches side by side: FlashMLA's fp8 path, ours with a bf16 query, ours in the fp8-query mode.

The fp8-query mode (MlaConfig::fp8_query: q quantized to e4m3 with a per-tensor q_scale, P
rounded to e4m3) is meant to be at least as fast as FlashMLA's fp8 path at 128 heads, which
quantizes the query too. The anchors benchmark (`anchors.py`, from ../shared/bench) times our
default fp8 mode only; this script reuses its cases, loaders, timing (median of CUDA-graph
replays), reference and ceilings on its fp8 grid. Both quantized paths get the same dynamic
per-tensor q_scale, max |q| / 448, as anchors.py gives FlashMLA; errors are against the fp32
reference of the unquantized q.

Runs on the GPU machine: python3 scripts/gpu/anchors_fp8q.py --ref .anchors --out FILE.json
"""
import json, sys

import torch

from anchors_lib import cells, measure, ok, setup, summary


def run_ours(mla_rs, c, fp8_query):
    B, H = c["B"], c["H"]
    dec = mla_rs.MlaDecode(num_heads=H, scale=c["scale"], kv_cache_dtype="fp8", fp8_query=fp8_query)
    o = torch.empty(B, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, H, device="cuda", dtype=torch.float32)
    # Tensors: read on the device, as a captured serving step reads them.
    q_scale = (c["q"].float().abs().amax() / 448.0).reshape(1)
    extra = dict(q_scale=q_scale) if fp8_query else {}

    def fn():
        dec.forward(c["q"], c["kv"], c["block_table"], c["lens"], k_scale=c["k_scale"], out=o, lse_out=lse, **extra)
    fn()
    torch.cuda.synchronize()
    dec.check_device_errors()
    return fn, o, lse


def main():
    a, A = setup()
    import mla_rs
    fm, fm_err = A.load_flashmla(a.ref)
    ceil = A.ceilings()
    print(f"device {torch.cuda.get_device_name()} copy={ceil['copy_TBps']:.2f} TB/s "
          f"bf16mm={ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; FlashMLA: {fm_err or 'ok'}", flush=True)
    shapes = ((1, 1024), (1, 8192), (4, 32768), (8, 4096), (32, 4096), (64, 8192), (128, 2048), (128, 16384),
              (256, 4096))
    grid = [(B, H, ctx) for H in (128, 16) for (B, ctx) in shapes]
    rows = []
    for (B, H, ctx) in grid:
        c = A.make_case(B, H, ctx, 64, True, seed=B * 1000 + H + ctx, vary=False)
        c["scale"] = A.SCALE
        ro, rl = A.reference(c)
        n = ro.shape[0]
        byts, flops = A.bytes_flops(c)
        # The fp8 floor: the bytes, or the FLOPs at twice the bf16 rate (fp8 tensor cores).
        floor_us = max(byts / (ceil["copy_TBps"] * 1e12), flops / (2 * ceil["bf16_mm_TFLOPs"] * 1e12)) * 1e6
        row = dict(B=B, H=H, ctx=ctx, floor_us=floor_us)
        impls = [("ours", lambda: run_ours(mla_rs, c, False)), ("ours_q8", lambda: run_ours(mla_rs, c, True))]
        if fm is not None:
            impls.append(("flashmla", lambda: A.run_flashmla(fm, c)))
        row.update(measure(A, impls, n, ro, rl))
        rows.append(row)
        print(f"B={B:3d} H={H:3d} ctx={ctx:5d} floor={floor_us:7.1f}us  "
              f"{cells(row, ('flashmla', 'ours', 'ours_q8'))}", flush=True)
        del c
        torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), ceilings=ceil, rows=rows), open(a.out, "w"), indent=1)
    for H in (128, 16):
        for ours in ("ours", "ours_q8"):
            ratios = [r["flashmla"]["us"] / r[ours]["us"] for r in rows if r["H"] == H and ok(r, ours) and ok(r, "flashmla")]
            print(summary(ratios, f"H={H} {ours} vs FlashMLA fp8"))


if __name__ == "__main__":
    sys.exit(main())
