"""The CPU backend side by side with PyTorch eager doing the same math, and the roofline of
this machine, as one markdown report.

PyTorch's side: per request, bf16 `q @ k^T * scale`, softmax, `@ v` with v the first 512
columns of the same contiguous keys (no paging, no splits). mla's side: `mla bench --backend
cpu --kv-dtype bf16|fp8` on the same shapes (paged cache, split-KV, checked against the f64
reference). Roofline: DRAM bandwidth by a large copy, bf16 peak by a large bf16 matmul.

Run: scripts/cpu/bench.sh (builds mla, makes the venv, runs this).
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

CASES = [(8, 16, 4096), (8, 128, 4096)]
L, D = 512, 576


def median_ms(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def torch_ms(batch, heads, ctx, iters):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, D, generator=g).bfloat16()
    k = torch.randn(batch, ctx, D, generator=g).bfloat16()
    scale = 192 ** -0.5

    def step():
        s = torch.bmm(q, k.transpose(1, 2)) * scale
        p = torch.softmax(s, dim=-1)
        return torch.bmm(p, k[:, :, :L])

    with torch.no_grad():
        return median_ms(step, iters)


def mla_ms(mla, batch, heads, ctx, kv, iters, kernel):
    out = subprocess.run(
        [mla, "bench", "--backend", "cpu", "--batch", str(batch), "--heads", str(heads),
         "--ctx", str(ctx), "--kv-dtype", kv, "--iters", str(iters), "--cpu-kernel", kernel,
         "--json"],
        check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1]
    m = json.loads(out)
    return m["us"] / 1e3, m["kernel"]


def dram_gbps():
    src = torch.empty(1 << 28, dtype=torch.float32).fill_(1.0)  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / (ms / 1e3) / 1e9


def bf16_tflops():
    n = 4096
    a = torch.randn(n, n).bfloat16()
    b = torch.randn(n, n).bfloat16()
    ms = median_ms(lambda: a @ b, 3)
    return 2 * n**3 / (ms / 1e3) / 1e12


def cpu_model():
    model, flags = "?", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = [x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "amx", "fma"))]
    return model, flags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mla", default="target/release/mla")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kernel", default="auto", help="mla's --cpu-kernel")
    args = ap.parse_args()

    model, flags = cpu_model()
    gbps, peak = dram_gbps(), bf16_tflops()
    print(f"CPU: {model}, {os.cpu_count()} threads; {' '.join(flags)}")
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"roofline: DRAM {gbps:.1f} GB/s (1 GiB copy), bf16 {peak:.3f} TFLOP/s (4096^3 matmul)")
    print()
    print("| case | mla bf16 (ms) | mla fp8 (ms) | torch eager (ms) | torch / mla bf16 | DRAM time of the bf16 cache (ms) | compute floor (ms) | mla kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch, heads, ctx in CASES:
        t_torch = torch_ms(batch, heads, ctx, args.iters)
        t_bf16, kernel = mla_ms(args.mla, batch, heads, ctx, "bf16", args.iters, args.kernel)
        t_fp8, _ = mla_ms(args.mla, batch, heads, ctx, "fp8", args.iters, args.kernel)
        dram_ms = batch * ctx * D * 2 / (gbps * 1e9) * 1e3
        flop_ms = 2 * batch * heads * ctx * (D + L) / (peak * 1e12) * 1e3
        print(f"| {batch} x {heads} x {ctx} | {t_bf16:.1f} | {t_fp8:.1f} | {t_torch:.1f} | "
              f"{t_torch / t_bf16:.2f}x | {dram_ms:.1f} | {flop_ms:.1f} | {kernel} |")


if __name__ == "__main__":
    main()
