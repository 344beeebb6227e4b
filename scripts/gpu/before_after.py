"""Two builds of the CLI on the anchors' grid (the shapes of ../shared/bench/anchors.py: 16 and 128
heads, bf16 and fp8 caches, batch 1 to 256, 1k to 32k keys, pages of 64, and two batches of
varied lengths), one `mla bench --json` process a case and a build, the builds alternating
(before first on even cases, after first on odd ones, so that neither always runs on a warmer
GPU). Prints one line a case (old us, new us, old/new: > 1 the new build is faster, and the
family each ran) and the geometric mean of the ratios; writes every row as JSON to --out.

  python3 scripts/gpu/before_after.py --before gpu-bin-main --after gpu-bin [--out FILE]
      [--cases "B H CTX KV [more bench arguments]; ..."] [--args-before ARGS] [--args-after ARGS]

--args-before / --args-after add `mla bench` arguments to one side only (`--kernel wgmma-fp8`,
`--schedule`, `--no-pdl`: one setting against another on the same build).
"""
import argparse
import json
import math
import shlex
import subprocess


def anchors_grid():
    """The cases of anchors.py's grid, as `mla bench` arguments."""
    cases = []
    for heads in (16, 128):
        for kv in ("bf16", "fp8"):
            for batch, ctx in ((1, 1024), (1, 8192), (4, 32768), (8, 4096), (32, 4096), (64, 8192),
                               (128, 2048), (128, 16384), (256, 4096)):
                cases.append(f"{batch} {heads} {ctx} {kv}")
    cases += ["64 128 8192 bf16 --varlen", "64 16 8192 bf16 --varlen"]
    return cases


def bench(binary, case, extra, iters):
    """One case on one build: `mla bench`'s JSON line, or dict(error=...)."""
    batch, heads, ctx, kv, *more = case.split()
    cmd = [f"{binary}/mla", "bench", "--backend", "cuda", "--batch", batch, "--heads", heads, "--ctx", ctx,
           "--page", "64", "--kv-dtype", kv, "--iters", str(iters), "--json", *more, *shlex.split(extra)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            return dict(error=(p.stderr.strip().splitlines() or ["rc %d" % p.returncode])[-1][:200])
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return dict(error=str(e)[:200])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the old build's folder (its mla)")
    ap.add_argument("--after", required=True, help="the new build's folder (its mla)")
    ap.add_argument("--cases", default="", help='"B H CTX KV [bench arguments]; ..." (default: the anchors grid)')
    ap.add_argument("--args-before", default="")
    ap.add_argument("--args-after", default="")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cases = [c.strip() for c in a.cases.split(";") if c.strip()] or anchors_grid()
    sides = [("before", a.before, a.args_before), ("after", a.after, a.args_after)]
    print(f"before: {a.before} {a.args_before}".rstrip())
    print(f"after:  {a.after} {a.args_after}".rstrip())
    print(f"{'case':34s} {'old us':>9s} {'new us':>9s} {'old/new':>7s}  kernels (old -> new)", flush=True)
    rows, ratios = [], []
    for i, case in enumerate(cases):
        order = sides if i % 2 == 0 else sides[::-1]
        row = dict(case=case)
        for name, binary, extra in order:
            row[name] = bench(binary, case, extra, a.iters)
        rows.append(row)
        old, new = row["before"], row["after"]
        if "us" in old and "us" in new:
            ratio = old["us"] / new["us"]
            ratios.append(ratio)
            print(f"{case:34s} {old['us']:9.1f} {new['us']:9.1f} {ratio:7.2f}  "
                  f"{old.get('kernel', '?')} -> {new.get('kernel', '?')}", flush=True)
        else:
            print(f"{case:34s} failed: before {old.get('error', 'ok')}; after {new.get('error', 'ok')}", flush=True)
    if ratios:
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"old/new: geomean {gm:.3f} over {len(ratios)} cases, min {min(ratios):.2f}, max {max(ratios):.2f}")
    failed = len(cases) - len(ratios)
    if failed:
        print(f"{failed} cases failed")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
