"""The decode as a ``torch.library`` custom op, ``torch.ops.mla_rs.decode``, so that
``torch.compile(fullgraph=True)`` traces through it (its fake implementation writes nothing
and allocates nothing: the op only mutates ``out`` and ``lse_out``) and
``torch.compile(mode="reduce-overhead")`` replays it in CUDA graphs.

A decoder is not a tensor: the op names it by a handle from ``handle(decoder)``, which keeps
the decoder alive. ``DecodeOp`` is the convenient entry point; it allocates the outputs when
none are given, inside the traced graph.
"""

from typing import Optional

import torch

from ._mla_rs import MlaDecode

_decoders: dict[int, MlaDecode] = {}

# "no value" for the op's integer max_seq_len (a schema int has no None)
_NO_MAX = -1


def handle(decoder: MlaDecode) -> int:
    """The op's name for `decoder`; it stays alive as long as the module does."""
    key = id(decoder)
    _decoders[key] = decoder
    return key


@torch.library.custom_op("mla_rs::decode", mutates_args=("out", "lse_out"))
def _decode_op(
    decoder: int,
    q: torch.Tensor,
    q_pe: Optional[torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    k_scale_value: float,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    query_len: int,
    causal: bool,
    max_seq_len: int,
) -> None:
    dec = _decoders.get(decoder)
    if dec is None:
        raise ValueError(f"decoder: {decoder} is not a handle from mla_rs.ops.handle")
    dec.forward(
        q if q_pe is None else (q, q_pe),
        kv_cache,
        block_table,
        seq_lens,
        k_scale=k_scale_value if k_scale is None else k_scale,
        query_len=query_len,
        causal=causal,
        out=out,
        lse_out=lse_out,
        max_seq_len=None if max_seq_len == _NO_MAX else max_seq_len,
    )


@_decode_op.register_fake
def _decode_fake(decoder, q, q_pe, kv_cache, block_table, seq_lens, k_scale, k_scale_value, out, lse_out,
                 query_len, causal, max_seq_len) -> None:
    return None


class DecodeOp:
    """A decoder called through ``torch.ops.mla_rs.decode``: ``DecodeOp(decoder)(q, kv_cache,
    block_table, seq_lens, ...)`` returns ``(o, lse)`` as ``decoder.forward`` does.

    Its state is plain Python ints, so that torch.compile traces a call without a graph break;
    ``q`` is a tensor ``[rows, H, 576]`` or a pair ``(q_nope, q_pe)``, ``k_scale`` a float or a
    one-element float32 tensor. Under CUDA graphs, reserve the decoder's workspace first.
    """

    def __init__(self, decoder: MlaDecode):
        self.decoder = handle(decoder)
        self.q_heads = decoder.q_heads
        self.kv_lora_rank = decoder.kv_lora_rank

    def __call__(self, q, kv_cache, block_table, seq_lens, *, k_scale=None, query_len=1, causal=True, out=None,
                 lse_out=None, max_seq_len=None):
        q_nope, q_pe = (q[0], q[1]) if isinstance(q, tuple) else (q, None)
        rows = q_nope.shape[0]
        if out is None:
            out = torch.empty((rows, self.q_heads, self.kv_lora_rank), dtype=q_nope.dtype, device=q_nope.device)
        if lse_out is None:
            lse_out = torch.empty((rows, self.q_heads), dtype=torch.float32, device=q_nope.device)
        scale_tensor = k_scale if isinstance(k_scale, torch.Tensor) else None
        scale_value = 1.0 if k_scale is None or scale_tensor is not None else float(k_scale)
        torch.ops.mla_rs.decode(
            self.decoder, q_nope, q_pe, kv_cache, block_table, seq_lens, scale_tensor, scale_value, out, lse_out,
            query_len, causal, _NO_MAX if max_seq_len is None else int(max_seq_len),
        )
        return out, lse_out
