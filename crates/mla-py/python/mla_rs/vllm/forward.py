"""The body of ``MlaRsImpl.forward_mqa`` without vLLM: an ``MlaDecode`` over vLLM's decode
metadata (any object with its fields: ``max_seq_len``, ``causal``, ``decode.block_table``,
``decode.seq_lens``). Shared by the backend class and the GPU tests, which run where vLLM is
not installed."""

import torch


def forward_mqa(dec, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
    """``(o [rows, H, kv_lora_rank] in q's dtype, lse [rows, H] float32)``. No host
    synchronization; under CUDA-graph capture the decoder's scratch is locked first, so a
    capture that would need more is an error, never an allocation."""
    decode = attn_metadata.decode
    if decode is None:
        raise ValueError("attn_metadata: forward_mqa needs decode metadata (attn_metadata.decode is None)")
    first = q[0] if isinstance(q, tuple) else q
    rows = first.shape[0]
    num_decodes = decode.seq_lens.shape[0]
    # Uniform blocks: query_len rows a request (mla reports a non-uniform block).
    query_len = max(1, rows // num_decodes) if num_decodes else 1
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        dec.lock_workspace()
    # The cache goes as vLLM hands it: mla reads a 1-byte cache in the decoder's own fp8
    # format. max_seq_len (local under DCP) is the split hint; nothing reads seq_lens on the host.
    # Without out and lse_out the decoder allocates both on q's device (o in q's dtype).
    return dec.forward(
        q,
        kv_c_and_k_pe_cache,
        decode.block_table,
        decode.seq_lens,
        k_scale=k_scale,
        query_len=query_len,
        causal=attn_metadata.causal,
        max_seq_len=attn_metadata.max_seq_len,
    )
