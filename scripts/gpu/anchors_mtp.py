"""Multi-token decode (the speculative-decoding verify step) side by side: FlashMLA, FA3 and ours.

The anchors benchmark (`anchors.py`, from ../shared/bench) times one query token a request;
serving also decodes uniform causal rows of 2 and 4 tokens. This script reuses its loaders,
timing (median of CUDA-graph replays) and ceilings, on cases of B requests x q_len tokens:
query token i of a request sees keys [0, len - (q_len - 1 - i)), as vLLM, FlashMLA and FA3
define it. Every implementation is checked against an fp32 reference first. bf16 cache only
(FA3 has no fp8 path; FlashMLA's fp8 path quantizes the query).

Runs on the GPU machine: python3 scripts/gpu/anchors_mtp.py --ref .anchors --out FILE.json
"""
import json, sys

import torch

from anchors_lib import cells, measure, ok, setup, summary


def make_case(A, B, H, ctx, q_len, seed):
    """anchors.make_case's cache and table, with B * q_len query rows."""
    c = A.make_case(B, H, ctx, 64, False, seed, False)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    c["q"] = torch.randn(B * q_len, H, A.D, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    c["q_len"] = q_len
    return c


def reference(A, c, requests=2):
    """fp32 causal attention of the first `requests` requests: o [rows, H, DV], lse [rows, H]."""
    q_len, outs, lses = c["q_len"], [], []
    for b in range(min(requests, c["B"])):
        n = int(c["lens"][b])
        blocks = c["block_table"][b, : (n + c["page"] - 1) // c["page"]].long()
        kv = c["kv_deq"][blocks].reshape(-1, A.D)[:n]
        for i in range(q_len):
            keys = kv[: n - (q_len - 1 - i)]
            s = (c["q"][b * q_len + i].float() @ keys.T) * A.SCALE
            lses.append(torch.logsumexp(s, -1))
            outs.append(torch.softmax(s, -1) @ keys[:, : A.DV])
    return torch.stack(outs), torch.stack(lses)


def run_flashmla(fm, c):
    ops, _ = fm
    B, H, q_len = c["B"], c["H"], c["q_len"]
    q = c["q"].view(B, q_len, H, -1)
    cache = c["kv"].unsqueeze(2)
    state = {"meta": None, "splits": None}

    def fn():
        out, lse, meta, splits = ops.dense_decode_fwd(q, cache, 512, c["lens"], c["block_table"], c["scale"], True,
                                                      state["meta"], state["splits"], None)
        state["meta"], state["splits"] = meta, splits
        return out, lse
    out, lse = fn()
    torch.cuda.synchronize()
    # out [B, q_len, H, DV]; lse [B, H, q_len]
    return fn, out.reshape(B * q_len, H, -1), lse.transpose(1, 2).reshape(B * q_len, H)


def run_ours(mla_rs, c):
    rows, H = c["q"].shape[0], c["H"]
    dec = mla_rs.MlaDecode(num_heads=H, scale=c["scale"], kv_cache_dtype="auto")
    o = torch.empty(rows, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(rows, H, device="cuda", dtype=torch.float32)

    def fn():
        dec.forward(c["q"], c["kv"], c["block_table"], c["lens"], query_len=c["q_len"], causal=True, out=o,
                    lse_out=lse)
    fn()
    torch.cuda.synchronize()
    return fn, o, lse


def main():
    a, A = setup()
    import mla_rs
    fm, fm_err = A.load_flashmla(a.ref)
    fa3, fa3_err = A.load_fa3(a.ref)
    ceil = A.ceilings()
    print(f"device {torch.cuda.get_device_name()} copy={ceil['copy_TBps']:.2f} TB/s "
          f"bf16mm={ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; FlashMLA: {fm_err or 'ok'}; FA3: {fa3_err or 'ok'}", flush=True)
    grid = [(B, 16, ctx, q) for q in (2, 4) for (B, ctx) in ((1, 4096), (8, 4096), (32, 8192), (64, 8192), (128, 4096))]
    grid += [(B, 128, ctx, 2) for (B, ctx) in ((1, 4096), (32, 4096), (64, 8192))]
    rows = []
    for (B, H, ctx, q_len) in grid:
        c = make_case(A, B, H, ctx, q_len, seed=B * 1000 + H + ctx + q_len)
        c["scale"] = A.SCALE
        ro, rl = reference(A, c)
        n = ro.shape[0]
        keys = int(c["lens"].sum())
        byts = keys * A.D * 2 + B * q_len * H * (A.D + A.DV) * 2
        flops = 2 * H * q_len * keys * (A.D + A.DV)
        floor_us = max(byts / (ceil["copy_TBps"] * 1e12), flops / (ceil["bf16_mm_TFLOPs"] * 1e12)) * 1e6
        row = dict(B=B, H=H, ctx=ctx, q_len=q_len, floor_us=floor_us)
        impls = [("ours", lambda: run_ours(mla_rs, c))]
        if fm is not None:
            impls.append(("flashmla", lambda: run_flashmla(fm, c)))
        if fa3 is not None:
            impls.append(("fa3", lambda: A.run_fa3(fa3, c, q_len)[:3]))
        row.update(measure(A, impls, n, ro, rl))
        rows.append(row)
        print(f"B={B:3d} H={H:3d} ctx={ctx:5d} q={q_len} floor={floor_us:7.1f}us  "
              f"{cells(row, ('flashmla', 'fa3', 'ours'))}", flush=True)
        del c
        torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), ceilings=ceil, rows=rows), open(a.out, "w"), indent=1)
    ratios = [min(r[k]["us"] for k in ("flashmla", "fa3") if ok(r, k)) / r["ours"]["us"]
              for r in rows if ok(r, "ours") and (ok(r, "flashmla") or ok(r, "fa3"))]
    print(summary(ratios, "ours vs best of FlashMLA, FA3"))


if __name__ == "__main__":
    sys.exit(main())
