"""A drop-in for vLLM's Triton decode kernel entry point, for the MLA case.

``decode_attention_fwd`` takes the arguments of
``vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd`` and writes ``o`` and
``lse`` in place, as vLLM's kernel does. Each row of ``q`` is one decode row with its own block
table row and length (vLLM expands multi-token rows before the call). ``attn_logits`` only
lends room for the float32 LSE when ``lse`` is bf16 or f16; mla keeps its own scratch.
``num_kv_splits == 1`` is how vLLM's batch-invariant mode reaches the kernel: it runs mla's
batch-invariant decode (one split, the same reduction order whatever the batch); any other
count is left to mla's own split rule.

One ``MlaDecode`` is kept per (device, heads, scale, dtypes, widths, batch invariance). Its
scratch is sized by ``max_seq_len`` (the batch's longest length or an upper bound, such as
vLLM's metadata ``max_seq_len``), else by the first call's longest length (one host
synchronization). Under ``torch.cuda.graph`` capture it never allocates or synchronizes: the
scratch must have been reserved by an earlier call outside the capture (a warmup), and it is
locked from then on, so a capture that would need more is a clear error.

The backend class and the plugin are in ``mla_rs.vllm.backend`` and ``mla_rs.vllm.plugin``.
"""

from .._mla_rs import MlaDecode

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


def _decoder(q, k_buffer, lora, sm_scale, batch_invariant):
    heads = q.shape[1]
    kv_dtype = _CACHE_DTYPES.get(str(k_buffer.dtype))
    if kv_dtype is None:
        raise ValueError(f"k_buffer: dtype {k_buffer.dtype} is not a cache dtype mla reads")
    key = (q.device, heads, float(sm_scale), str(q.dtype), kv_dtype, k_buffer.shape[-1], lora, batch_invariant)
    dec = _decoders.get(key)
    if dec is None:
        dec = MlaDecode(
            heads,
            float(sm_scale),
            kv_cache_dtype=kv_dtype,
            kv_lora_rank=lora,
            qk_rope_head_dim=k_buffer.shape[-1] - lora,
            dtype=q.dtype,
            batch_invariant=batch_invariant,
        )
        _decoders[key] = dec
    return dec


def _check_capture(dec, max_seq_len):
    """Under CUDA-graph capture: the scratch must be there already (no allocation, no read of
    the lengths), and it is locked so that a call needing more fails instead of allocating."""
    if not _capturing():
        return
    reserved = dec.reserved_model_len
    if reserved is None or (max_seq_len is not None and max_seq_len > reserved):
        raise ValueError(
            f"max_seq_len: under CUDA-graph capture the scratch must already hold {max_seq_len or 'the batch'} "
            f"keys (reserved: {reserved}); make one call outside the capture first, with max_seq_len >= the "
            f"longest length the graph will see"
        )
    dec.lock_workspace()


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
    *,
    max_seq_len=None,
):
    """vLLM's ``decode_attention_fwd`` for MLA: ``q [rows, H, 576]``, ``k_buffer [blocks,
    page_size, 1, 576]`` (or without the head dim), ``v_buffer`` its first 512 columns,
    ``o [rows, H, 512]`` and ``lse [rows, H]`` written in place, ``req_to_token [rows,
    max_blocks]`` int32, ``b_seq_len [rows]`` int32, ``k_scale`` a float or a one-element
    float32 tensor (``v_scale``, if given, must be the same: MLA's values are its keys).
    ``max_seq_len``: the batch's longest length (or an upper bound), which sizes the scratch
    and picks the split count without reading ``b_seq_len``."""
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
    if max_seq_len is not None and max_seq_len < 0:
        raise ValueError(f"max_seq_len: expected a value >= 0, got {max_seq_len}")
    dec = _decoder(q, kv, lora, sm_scale, batch_invariant=num_kv_splits == 1)
    _check_capture(dec, max_seq_len)
    if str(lse.dtype) == "torch.float32":
        dec.forward(q, kv, req_to_token, b_seq_len, k_scale=k_scale, out=o, lse_out=lse, max_seq_len=max_seq_len)
        return
    # A bf16/f16 lse: the float32 LSE lands in attn_logits' storage, then is rounded in place.
    rows, heads = q.shape[0], q.shape[1]
    scratch = attn_logits.reshape(-1)[: rows * heads].view(rows, heads)
    dec.forward(q, kv, req_to_token, b_seq_len, k_scale=k_scale, out=o, lse_out=scratch, max_seq_len=max_seq_len)
    lse.copy_(scratch)
