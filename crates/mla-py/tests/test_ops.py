"""torch.ops.mla_rs.decode: the custom op's schema and fake implementation (torch.library's own
checks), and torch.compile(fullgraph=True) tracing a function that calls it, on CPU tensors.
The CUDA-graph half (mode="reduce-overhead") is in test_gpu_vllm.py."""

import pytest

torch = pytest.importorskip("torch")

import mla_rs  # noqa: E402
from mla_rs.ops import DecodeOp  # noqa: E402
from reference import L, SCALE, assert_close, make_case, reference  # noqa: E402


def case_and_op():
    c = make_case(3, 16, [700, 33, 0], 16, device="cpu")
    return c, DecodeOp(mla_rs.MlaDecode(16, SCALE, device="cpu"))


def test_torch_librarys_checks_pass_on_the_op():
    c, op = case_and_op()
    out = torch.empty(3, 16, L, dtype=torch.bfloat16)
    lse = torch.empty(3, 16, dtype=torch.float32)
    args = (op.decoder, c["q"], None, c["kv"], c["block_table"], c["seq_lens"], None, 1.0, out, lse, 1, True, 1024)
    torch.library.opcheck(torch.ops.mla_rs.decode.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_fullgraph_compile_traces_a_function_that_decodes():
    c, op = case_and_op()

    def attend(q, kv, table, lens):
        o, lse = op((q[..., :L], q[..., L:]), kv, table, lens, max_seq_len=1024)
        return o * 2, lse

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    o, lse = compiled(c["q"], c["kv"], c["block_table"], c["seq_lens"])
    ref_o, ref_lse = reference(c)
    assert_close(o / 2, lse, ref_o, ref_lse)


def test_an_unknown_handle_is_refused():
    c, op = case_and_op()
    out = torch.empty(3, 16, L, dtype=torch.bfloat16)
    lse = torch.empty(3, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="decoder: .* is not a handle"):
        torch.ops.mla_rs.decode(12345, c["q"], None, c["kv"], c["block_table"],
                                c["seq_lens"], None, 1.0, out, lse, 1, True, -1)
