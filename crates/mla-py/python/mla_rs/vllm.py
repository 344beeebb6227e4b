"""A drop-in for vLLM's Triton decode kernel entry point, for the MLA case.

``decode_attention_fwd`` takes the arguments of
``vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd`` and writes ``o`` and
``lse`` in place, as vLLM's kernel does. Each row of ``q`` is one decode row with its own block
table row and length (vLLM expands multi-token rows before the call). ``attn_logits`` and
``num_kv_splits`` are accepted and not needed: mla picks its own split count and keeps its own
scratch; ``attn_logits`` only lends room for the float32 LSE when ``lse`` is bf16 or f16.

One ``MlaDecode`` is kept per (device, heads, scale, dtypes, widths). Its first call reads the
batch's longest length (one host synchronization) and reserves scratch for it; later calls
(including under ``torch.cuda.graph`` capture) allocate nothing as long as they fit.
"""

from ._mla_rs import MlaDecode

_decoders = {}

_CACHE_DTYPES = {
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.uint8": "fp8_e4m3",  # vLLM stores an fp8 cache as uint8 and views it as e4m3
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
}


def _same_scale(a, b):
    """Whether two scales are one: the same object or the same tensor storage needs no read of
    device memory (vLLM passes ``layer._k_scale`` as both). Only two different scales are read,
    which synchronizes with the device, so it is refused under CUDA-graph capture."""
    if a is b:
        return True
    ptr = getattr(a, "data_ptr", None), getattr(b, "data_ptr", None)
    if all(ptr) and ptr[0]() == ptr[1]():
        return True
    if any(ptr) and _capturing():
        raise ValueError("v_scale: under CUDA-graph capture, pass the k_scale tensor itself")
    return float(a) == float(b)


def _capturing():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _decoder(q, k_buffer, lora, sm_scale):
    heads = q.shape[1]
    kv_dtype = _CACHE_DTYPES.get(str(k_buffer.dtype))
    if kv_dtype is None:
        raise ValueError(f"k_buffer: dtype {k_buffer.dtype} is not a cache dtype mla reads")
    key = (q.device, heads, float(sm_scale), str(q.dtype), kv_dtype, k_buffer.shape[-1], lora)
    dec = _decoders.get(key)
    if dec is None:
        dec = MlaDecode(
            heads,
            float(sm_scale),
            kv_cache_dtype=kv_dtype,
            kv_lora_rank=lora,
            qk_rope_head_dim=k_buffer.shape[-1] - lora,
            dtype=q.dtype,
        )
        _decoders[key] = dec
    return dec


def decode_attention_fwd(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size=1,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
    is_mla=False,
):
    """vLLM's ``decode_attention_fwd`` for MLA: ``q [rows, H, 576]``, ``k_buffer [blocks,
    page_size, 1, 576]`` (or without the head dim), ``v_buffer`` its first 512 columns,
    ``o [rows, H, 512]`` and ``lse [rows, H]`` written in place, ``req_to_token [rows,
    max_blocks]`` int32, ``b_seq_len [rows]`` int32, ``k_scale`` a float or a one-element
    float32 tensor (``v_scale``, if given, must be the same: MLA's values are its keys)."""
    if not is_mla:
        raise NotImplementedError(
            "mla_rs.decode_attention_fwd implements the MLA case only (is_mla=True: one latent "
            "KV head whose first kv_lora_rank columns are the values)"
        )
    if logit_cap and logit_cap > 0:
        raise NotImplementedError("mla does not support one of the following: alibi_slopes, logits_soft_cap")
    kv = k_buffer.squeeze(2) if k_buffer.dim() == 4 else k_buffer
    if kv.dim() != 3:
        raise ValueError(f"k_buffer: expected [blocks, page_size, 1, D] or [blocks, page_size, D], got {tuple(k_buffer.shape)}")
    if kv.shape[1] != page_size:
        raise ValueError(f"page_size: expected {kv.shape[1]} (k_buffer's), got {page_size}")
    if v_buffer is not None and v_buffer.data_ptr() != k_buffer.data_ptr():
        raise ValueError("v_buffer: expected a view of k_buffer's first kv_lora_rank columns (MLA)")
    lora = v_buffer.shape[-1] if v_buffer is not None else 512
    if v_scale is not None and k_scale is not None and not _same_scale(v_scale, k_scale):
        raise ValueError("v_scale: expected the same scale as k_scale (MLA's values are its keys)")
    dec = _decoder(q, kv, lora, sm_scale)
    if str(lse.dtype) == "torch.float32":
        dec.forward(q, kv, req_to_token, b_seq_len, k_scale=k_scale, out=o, lse_out=lse)
        return
    # A bf16/f16 lse: the float32 LSE lands in attn_logits' storage, then is rounded in place.
    rows, heads = q.shape[0], q.shape[1]
    scratch = attn_logits.reshape(-1)[: rows * heads].view(rows, heads)
    dec.forward(q, kv, req_to_token, b_seq_len, k_scale=k_scale, out=o, lse_out=scratch)
    lse.copy_(scratch)
