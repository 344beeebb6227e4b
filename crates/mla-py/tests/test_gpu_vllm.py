"""On the GPU, without vLLM (it cannot be installed there): the backend's forward_mqa path
(mla_rs.vllm.forward, which MlaRsImpl.forward_mqa calls) over metadata stand-ins with vLLM's
field names, against the float64 reference; CUDA-graph capture and replay with new lengths;
torch.compile fullgraph (inductor) and reduce-overhead through torch.ops.mla_rs.decode.
Skips without torch and a CUDA device."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with a CUDA device", allow_module_level=True)

import mla_rs  # noqa: E402
from mla_rs.ops import DecodeOp  # noqa: E402
from mla_rs.vllm.forward import forward_mqa  # noqa: E402
from reference import L, SCALE, assert_close, make_case, reference  # noqa: E402


def metadata(c, causal=True, max_seq_len=8192):
    decode = SimpleNamespace(block_table=c["block_table"], seq_lens=c["seq_lens"], dcp_tot_seq_lens=None)
    return SimpleNamespace(max_seq_len=max_seq_len, causal=causal, decode=decode)


CASES = [
    # heads, page, lens, kv, cache dtype, query_len, causal, window, split q
    (16, 64, [700, 1500, 33, 0], "bf16", "auto", 1, True, None, True),
    (128, 64, [4096, 1000], "bf16", "bfloat16", 1, True, None, True),
    (16, 16, [900, 5], "fp8", "fp8", 1, True, None, True),
    (16, 1, [300, 1200], "fp8_e5m2", "fp8_e5m2", 2, False, None, False),
    (64, 16, [2000, 77], "bf16", "auto", 4, True, 100, True),
]


@pytest.mark.parametrize("heads,page,lens,kv,cache,query_len,causal,window,split", CASES)
def test_forward_mqa_matches_the_reference(heads, page, lens, kv, cache, query_len, causal, window, split):
    c = make_case(len(lens), heads, lens, page, kv=kv, query_len=query_len, seed=heads + page)
    dec = mla_rs.MlaDecode(heads, SCALE, kv_cache_dtype=cache, sliding_window=window, dtype=torch.bfloat16)
    dec.reserve_workspace(len(lens) * query_len, 8192)
    store = c["kv"].view(torch.float8_e4m3fn) if cache.startswith("fp8") else c["kv"]  # as vLLM hands it
    q = (c["q"][..., :L].contiguous(), c["q"][..., L:]) if split else c["q"]
    k_scale = torch.tensor([c["k_scale"]], dtype=torch.float32, device="cuda")
    o, lse = forward_mqa(dec, q, store, metadata(c, causal), k_scale)
    dec.check_device_errors()
    assert_close(o, lse, *reference(c, causal=causal, window=window))


@pytest.mark.parametrize("query_len", [1, 2])
def test_forward_mqa_replays_in_a_graph_with_new_lengths(query_len):
    c = make_case(3, 16, [4000, 4000, 4000], 16, query_len=query_len)
    dec = mla_rs.MlaDecode(16, SCALE)
    dec.reserve_workspace(3 * query_len, 8192)
    dec.register_decode_warmup(c["kv"], "auto")
    seq_lens = c["seq_lens"].clone()
    meta = metadata(dict(c, seq_lens=seq_lens))
    forward_mqa(dec, c["q"], c["kv"], meta, None)  # warm (outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = forward_mqa(dec, c["q"], c["kv"], meta, None)
    for lens in ([1000, 300, 4000], [1, 0, 2500], [4000, 4000, 17]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        dec.check_device_errors()
        assert_close(o, lse, *reference(dict(c, seq_lens=seq_lens)), what=str(lens))


def test_a_capture_beyond_the_reservation_is_an_error_not_an_allocation():
    c = make_case(2, 16, [100, 40], 16)
    dec = mla_rs.MlaDecode(16, SCALE)
    dec.reserve_workspace(2, 1024)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="locked"):
        with torch.cuda.graph(graph):
            big = dict(c, q=torch.cat([c["q"]] * 64), block_table=c["block_table"].repeat(64, 1),
                       seq_lens=c["seq_lens"].repeat(64))
            forward_mqa(dec, big["q"], c["kv"], metadata(big, max_seq_len=1 << 20), None)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_runs_the_custom_op(mode):
    c = make_case(3, 16, [8000, 8000, 8000], 64)  # pages for the longest lengths below
    dec = mla_rs.MlaDecode(16, SCALE)
    dec.reserve_workspace(3, 8192)
    dec.register_decode_warmup(c["kv"], "auto")
    op = DecodeOp(dec)

    def attend(q, kv, table, lens):
        o, lse = op((q[..., :L], q[..., L:]), kv, table, lens, max_seq_len=8192)
        return o.float() * 2, lse

    compiled = torch.compile(attend, fullgraph=True, mode=mode)
    seq_lens = c["seq_lens"].clone()
    for lens in ([3000, 17, 900], [5, 4000, 1], [64, 64, 8000]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        o, lse = compiled(c["q"], c["kv"], c["block_table"], seq_lens)
        torch.cuda.synchronize()
        assert_close(o / 2, lse, *reference(dict(c, seq_lens=seq_lens)), what=f"{mode} {lens}")
