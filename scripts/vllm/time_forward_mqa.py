"""forward_mqa through the backend's path (mla_rs.vllm.forward, what MlaRsImpl.forward_mqa runs
after its warmup check) next to the kernel alone (MlaDecode.forward into preallocated outputs),
both captured in CUDA graphs and timed with CUDA events over replays; prints medians in us.

    python scripts/vllm/time_forward_mqa.py [--reps 200]
"""

import argparse
import statistics
from types import SimpleNamespace

import torch

import mla_rs
from mla_rs.vllm.forward import forward_mqa

SCALE = 192**-0.5
GRID = [  # heads, batch, seq_len, page, cache
    (16, 1, 4096, 64, "auto"), (16, 32, 4096, 64, "auto"), (128, 1, 4096, 64, "auto"),
    (128, 32, 4096, 64, "auto"), (128, 64, 8192, 64, "fp8"), (16, 128, 2048, 16, "fp8"),
]


def graph_time(fn, reps):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, mla_rs {mla_rs.__version__}, torch {torch.__version__}")
    print("heads batch seq_len page cache | kernel_us class_us diff_us")
    for heads, batch, n, page, cache in GRID:
        blocks = batch * (n // page)
        dt = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
        kv = (torch.randn(blocks, page, 576, device="cuda") * 0.5).to(dt)
        q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
        q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:]
        table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
        lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        k_scale = torch.ones(1, device="cuda")
        dec = mla_rs.MlaDecode(heads, SCALE, kv_cache_dtype=cache)
        dec.reserve_workspace(batch, n)
        dec.register_decode_warmup(kv, cache)
        o = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
        meta = SimpleNamespace(max_seq_len=n, causal=True,
                               decode=SimpleNamespace(block_table=table, seq_lens=lens, dcp_tot_seq_lens=None))
        kernel = graph_time(lambda: dec.forward((q_nope, q_pe), kv, table, lens, k_scale=k_scale, out=o,
                                                lse_out=lse, max_seq_len=n), args.reps)
        cls = graph_time(lambda: forward_mqa(dec, (q_nope, q_pe), kv, meta, k_scale), args.reps)
        print(f"{heads} {batch} {n} {page} {cache} | {kernel:.1f} {cls:.1f} {cls - kernel:+.1f}")


if __name__ == "__main__":
    main()
