"""The keywords vLLM's ``MLAAttention`` layer constructs an MLA impl with (DeepSeek-V3 shapes),
shared by the vLLM backend tests."""

from vllm.v1.attention.backend import AttentionType

from reference import SCALE


def impl_args(heads=16, kv_cache_dtype="auto", window=None, **overrides):
    args = dict(
        num_heads=heads, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None, sliding_window=window,
        kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None,
    )
    args.update(overrides)
    return args
