"""Times the mla_rs module in-process (CUDA-graph replay, as anchors.py does) on a few small
cases, for each wheel folder given: `python3 time_wheels.py DIR...` (each DIR holds an
installed mla_rs; one process per DIR so that each imports its own). Prints one line a case."""
import os
import subprocess
import sys

CASES = [(1, 16, 8192), (8, 16, 4096), (1, 128, 8192), (4, 16, 32768), (64, 16, 8192), (1, 16, 1024)]


def child(site):
    sys.path.insert(0, site)
    import torch
    import triton
    import mla_rs

    scale, page = 192 ** -0.5, 64
    for b, h, ctx in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        blocks = b * (ctx // page)
        kv = (torch.randn(blocks, page, 576, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
        q = torch.randn(b, h, 576, device="cuda", generator=g).to(torch.bfloat16)
        table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).view(b, -1)
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        dec = mla_rs.MlaDecode(h, scale)
        o = torch.empty(b, h, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, device="cuda", dtype=torch.float32)

        def fn():
            dec.forward(q, kv, table, lens, out=o, lse_out=lse)
        fn()
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        print(f"{os.path.basename(site):12s} B={b:3d} H={h:3d} ctx={ctx:6d} {us:7.1f} us", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        for site in sys.argv[1:]:
            subprocess.run([sys.executable, __file__, "--child", site], check=False)
