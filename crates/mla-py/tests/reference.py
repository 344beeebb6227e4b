"""Test cases and the float64 reference the mla_rs tests share (torch needed)."""

import math

import torch

D, L, R = 576, 512, 64
SCALE = 192**-0.5
O_TOL, LSE_TOL = 5e-3, 1e-3



def make_case(batch, heads, lens, page, kv="bf16", q_dtype=None, query_len=1, seed=0, k_scale=0.5, device="cuda"):
    """Random q ~ N(0, 1), cache ~ N(0, 0.5^2) (fp8 stores value / k_scale), pages in random order."""
    q_dtype = q_dtype or torch.bfloat16
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_req = max(1, -(-max(lens + [1]) // page))
    nblocks = batch * blocks_per_req + 3
    values = torch.randn(nblocks, page, D, generator=g, device=device) * 0.5
    if kv in ("fp8", "fp8_u8", "fp8_e5m2"):
        f8 = torch.float8_e5m2 if kv == "fp8_e5m2" else torch.float8_e4m3fn
        store = (values / k_scale).to(f8)
        deq = store.float() * k_scale
        if kv == "fp8_u8":
            store = store.view(torch.uint8)
    else:
        store = values.to(torch.bfloat16 if kv == "bf16" else torch.float16)
        deq = store.float()
        k_scale = 1.0
    deq = deq.to(q_dtype).float()  # what the products see: rounded to the query dtype
    perm = torch.randperm(nblocks, generator=g, device=device)[: batch * blocks_per_req]
    return dict(
        q=torch.randn(batch * query_len, heads, D, generator=g, device=device).to(q_dtype),
        kv=store,
        deq=deq,
        block_table=perm.to(torch.int32).view(batch, blocks_per_req).contiguous(),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        page=page,
        query_len=query_len,
        k_scale=k_scale,
    )


def reference(c, causal=True, window=None, deq=None):
    """float64 attention over the keys each row sees: (o [rows, H, L], lse [rows, H])."""
    deq = c["deq"] if deq is None else deq
    q, ql, page = c["q"].double(), c["query_len"], c["page"]
    rows, heads, dev = q.shape[0], q.shape[1], q.device
    o = torch.zeros(rows, heads, L, dtype=torch.float64, device=dev)
    lse = torch.full((rows, heads), -math.inf, dtype=torch.float64, device=dev)
    lens = c["seq_lens"].tolist()
    for r in range(rows):
        i, t = divmod(r, ql)
        end = max(0, lens[i] - (ql - 1 - t)) if causal else lens[i]
        start = max(0, end - window) if window else 0
        if end <= start:
            continue
        pos = torch.arange(start, end, device=dev)
        keys = deq[c["block_table"][i, pos // page].long(), pos % page].double()
        s = (q[r] @ keys.T) * SCALE
        lse[r] = torch.logsumexp(s, -1)
        o[r] = torch.softmax(s, -1) @ keys[:, :L]
    return o, lse


def poisoned(c, heads):
    rows, dev = c["q"].shape[0], c["q"].device
    return (
        torch.full((rows, heads, L), float("nan"), dtype=c["q"].dtype, device=dev),
        torch.full((rows, heads), float("nan"), dtype=torch.float32, device=dev),
    )


def assert_close(o, lse, ref_o, ref_lse, what="", o_tol=O_TOL, lse_tol=LSE_TOL):
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"unwritten outputs {what}"
    rel = float((o.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-30))
    assert rel <= o_tol, f"o error {rel:.3e} {what}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"-inf rows differ {what}"
    if finite.any():
        err = float((lse.double()[finite] - ref_lse[finite]).abs().max())
        assert err <= lse_tol, f"lse error {err:.3e} {what}"
