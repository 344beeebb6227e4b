"""The vLLM backend against real vLLM code (0.33.0, CPU-only: scripts/vllm/venv.sh), on CPU tensors.

What is vLLM's own here: the plugin loader and entry point, the backend registry,
``VllmConfig``/``ParallelConfig``/``DeviceConfig``, the ``MLACommonImpl`` constructor chain and the
metadata dataclasses. Stand-ins: the layer (only ``_k_scale`` is read), ``model_config`` (only
``dtype`` and ``max_model_len``: a real one needs a model download), and ``current_platform`` for
the capability refusals (no GPU here). vLLM's selector choosing the backend: test_vllm_selector.py.
"""

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vLLM 0.33.0 (scripts/vllm/venv.sh)")

from reference import L, SCALE, assert_close, make_case, reference  # noqa: E402
from vllm_layer import impl_args  # noqa: E402
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLACommonDecodeMetadata,
    MLACommonMetadata,
)
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

import mla_rs.vllm.backend as backend  # noqa: E402
from mla_rs.vllm.backend import MlaRsBackend, MlaRsImpl, MlaRsMetadataBuilder  # noqa: E402

MAX_MODEL_LEN = 4096


def vllm_config(dcp=1, model=True, dtype=torch.bfloat16):
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(decode_context_parallel_size=dcp, tensor_parallel_size=dcp),
    )
    if model:
        config.model_config = SimpleNamespace(dtype=dtype, max_model_len=MAX_MODEL_LEN)
    return config


def make_impl(heads=16, kv_cache_dtype="auto", window=None, dcp=1, dtype=torch.bfloat16, **kw):
    with set_current_vllm_config(vllm_config(dcp, dtype=dtype)):
        return MlaRsImpl(**impl_args(heads, kv_cache_dtype, window, **kw))


def metadata(c, causal=True, max_seq_len=None, dcp_tot=None):
    """vLLM's own decode metadata dataclasses over a case."""
    n = c["seq_lens"].shape[0]
    rows = c["q"].shape[0]
    ql = rows // n
    return MLACommonMetadata(
        num_reqs=n, max_query_len=ql, max_seq_len=int(c["seq_lens"].max()) if max_seq_len is None else max_seq_len,
        num_actual_tokens=rows, query_start_loc=torch.arange(0, rows + 1, ql, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=n, num_decode_tokens=rows, num_prefills=0,
        causal=causal, head_dim=576,
        decode=MLACommonDecodeMetadata(block_table=c["block_table"], seq_lens=c["seq_lens"], dcp_tot_seq_lens=dcp_tot),
    )


def layer(k_scale=1.0):
    return SimpleNamespace(_k_scale=torch.tensor([k_scale], dtype=torch.float32))


# ---------------------------------------------------------------- plugin, registry, selector


def test_the_entry_point_registers_the_backend_in_the_custom_slot(monkeypatch):
    import vllm.plugins as plugins
    from importlib.metadata import entry_points

    names = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "mla_rs"]
    assert names == ["mla_rs.vllm.plugin:register"]
    AttentionBackendEnum.CUSTOM.clear_override()
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "mla_rs")
    plugins.load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.is_overridden()
    assert AttentionBackendEnum.CUSTOM.get_class() is MlaRsBackend
    assert MlaRsBackend.get_name() == "MLA_RS"
    assert MlaRsBackend.get_builder_cls() is MlaRsMetadataBuilder


def test_the_attention_config_parses_custom():
    from vllm.config.attention import AttentionConfig

    assert AttentionConfig(backend="custom").backend is AttentionBackendEnum.CUSTOM
    per_kind = AttentionConfig(backend_per_kind={"mla_attention": "CUSTOM"}).backend_per_kind
    assert per_kind["mla_attention"] is AttentionBackendEnum.CUSTOM


# ---------------------------------------------------------------- construction


def test_construction_raises_the_seeds_errors(monkeypatch):
    with pytest.raises(NotImplementedError, match="alibi_slopes, logits_soft_cap"):
        make_impl(alibi_slopes=[0.5] * 16)
    with pytest.raises(NotImplementedError, match="alibi_slopes, logits_soft_cap"):
        make_impl(logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match="encoder/decoder cross-attention are not implemented"):
        make_impl(attn_type=AttentionType.ENCODER_DECODER)
    with pytest.raises(NotImplementedError, match="does not support decode context parallelism"):
        make_impl(window=128, dcp=2)

    def gpu(cap):
        return SimpleNamespace(
            is_cuda=lambda: True, get_device_capability=lambda: cap, get_device_name=lambda: "Tesla T4",
            has_device_capability=lambda n: cap.to_int() >= n,
        )

    monkeypatch.setattr(backend, "current_platform", gpu(DeviceCapability(8, 0)))
    with pytest.raises(ValueError, match=r"compute capability 8\.0.*SM89\+. Re-run with --kv-cache-dtype bfloat16"):
        make_impl(kv_cache_dtype="fp8")
    monkeypatch.setattr(backend, "current_platform", gpu(DeviceCapability(7, 5)))
    with pytest.raises(ValueError, match="--kv-cache-dtype float16"):
        make_impl(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match=r"bfloat16 requires SM80\+. Re-run with --kv-cache-dtype float16"):
        make_impl(kv_cache_dtype="bfloat16")
    monkeypatch.setattr(backend, "current_platform", gpu(DeviceCapability(8, 9)))
    assert make_impl(kv_cache_dtype="fp8").supports_quant_query_input is False
    assert make_impl(kv_cache_dtype="auto").supports_quant_query_input is True


def test_reserve_workspace_sizes_from_the_config_and_warmup_covers_its_splits(monkeypatch):
    impl = make_impl()
    impl.reserve_workspace()
    dec = impl._decoders[False]
    assert dec.reserved_model_len == MAX_MODEL_LEN and dec.workspace_bytes > 0
    c = make_case(2, 16, [100, 7], 16, device="cpu")
    counts = impl.register_decode_warmup(c["kv"], "auto")
    assert counts and counts == sorted(counts) and 1 in counts
    windowed = make_impl(window=64)
    assert max(windowed.register_decode_warmup(c["kv"], "auto")) <= max(counts)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert make_impl().register_decode_warmup(c["kv"], "auto") == [1]


def test_forward_mha_refuses_a_sliding_window():
    with pytest.raises(NotImplementedError, match="Sliding-window MLA_RS MLA prefill"):
        make_impl(window=64).forward_mha(None, None, None, None, None, None, None)


# ---------------------------------------------------------------- forward_mqa on CPU tensors

CASES = [
    # (heads, page, lens, cache dtype, q dtype, query_len, causal, window, split q)
    (16, 64, [700, 1500, 33, 0], "auto", torch.bfloat16, 1, True, None, False),
    (16, 1, [300, 90], "bfloat16", torch.bfloat16, 1, True, None, True),
    (16, 16, [900, 5], "fp8", torch.bfloat16, 1, True, None, True),
    (16, 16, [400, 77], "fp8_e5m2", torch.float16, 1, True, None, False),
    (32, 16, [600, 40], "float16", torch.float16, 3, True, None, True),
    (16, 64, [500, 64], "auto", torch.bfloat16, 4, False, None, False),
    (16, 16, [1000, 10, 257], "auto", torch.bfloat16, 2, True, 64, True),
]


def vllm_cache(c, cache_dtype):
    # MLAAttention hands every fp8 cache viewed as e4m3, whatever the dtype string.
    return c["kv"].view(torch.float8_e4m3fn) if cache_dtype.startswith("fp8") else c["kv"]


def split_q(q):
    # vLLM's q_pe is a slice of the layer's q: its head stride is qk_head_dim, not 64.
    full = torch.empty(q.shape[0], q.shape[1], 192, dtype=q.dtype)
    full[..., 128:] = q[..., L:]
    return q[..., :L].contiguous(), full[..., 128:]


@pytest.mark.parametrize("heads,page,lens,cache,qd,query_len,causal,window,split", CASES)
def test_forward_mqa_matches_the_reference(heads, page, lens, cache, qd, query_len, causal, window, split):
    kv = {"auto": "bf16", "bfloat16": "bf16", "float16": "f16", "fp8": "fp8", "fp8_e5m2": "fp8_e5m2"}[cache]
    c = make_case(len(lens), heads, lens, page, kv=kv, q_dtype=qd, query_len=query_len, device="cpu")
    impl = make_impl(heads, cache, window=window, dtype=qd)
    q = split_q(c["q"]) if split else c["q"]
    o, lse = impl.forward_mqa(q, vllm_cache(c, cache), metadata(c, causal), layer(c["k_scale"]))
    assert o.dtype == qd and o.shape == (c["q"].shape[0], heads, L)
    assert_close(o, lse, *reference(c, causal=causal, window=window))


def test_the_metadata_max_seq_len_is_the_split_hint():
    # Without a model config there is nothing to size from: the first call's max_seq_len is.
    c = make_case(2, 16, [300, 20], 16, device="cpu")
    with set_current_vllm_config(vllm_config(model=False)):
        impl = MlaRsImpl(16, 576, SCALE, 1, None, None, "auto", None, AttentionType.DECODER, None, q_lora_rank=None,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128,
                         kv_b_proj=None)
    o, lse = impl.forward_mqa(c["q"], c["kv"], metadata(c, max_seq_len=2000), layer())
    assert impl._decoders[False].reserved_model_len == 2000
    assert_close(o, lse, *reference(c))


def test_batch_invariant_mode_gives_each_row_the_same_bits_in_any_batch(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    c = make_case(3, 16, [3000, 5, 1200], 16, device="cpu")
    impl = make_impl()
    o, lse = impl.forward_mqa(c["q"], c["kv"], metadata(c), layer())
    assert impl._decoders.keys() == {True}
    alone = dict(c, q=c["q"][:1], block_table=c["block_table"][:1], seq_lens=c["seq_lens"][:1])
    o1, lse1 = impl.forward_mqa(alone["q"], c["kv"], metadata(alone), layer())
    assert torch.equal(o[:1], o1) and torch.equal(lse[:1], lse1)
    assert_close(o, lse, *reference(c))


def test_decode_context_parallelism_returns_lses_that_merge_to_the_whole():
    # Two ranks, interleave 1: token p on rank p % 2 at local position p // 2. Each rank decodes
    # its local keys for all heads x 2; merging by LSE must give attention over every key.
    ranks, heads = 2, 8
    c = make_case(2, heads * ranks, [301, 64], 1, device="cpu")
    impls = [make_impl(heads, dcp=ranks) for _ in range(ranks)]
    outs = []
    for r, impl in enumerate(impls):
        assert impl.dcp_world_size == ranks
        lens = c["seq_lens"].tolist()
        local_lens = [len(range(r, n, ranks)) for n in lens]
        table = torch.zeros(2, max(local_lens), dtype=torch.int32)
        for i, n in enumerate(lens):
            pos = torch.arange(r, n, ranks)
            table[i, : len(pos)] = c["block_table"][i, pos]
        local = dict(c, block_table=table, seq_lens=torch.tensor(local_lens, dtype=torch.int32))
        outs.append(impl.forward_mqa(c["q"], c["kv"], metadata(local, dcp_tot=c["seq_lens"]), layer()))
    lses = torch.stack([lse.double() for _, lse in outs])
    total = torch.logsumexp(lses, 0)
    o = sum(torch.exp(lse - total)[..., None] * oo.double() for (oo, _), lse in zip(outs, lses))
    assert_close(o, total, *reference(c))
    assert not math.isnan(float(total.sum()))


def test_a_non_uniform_block_and_missing_decode_metadata_are_refused():
    impl = make_impl()
    c = make_case(2, 16, [30, 20], 16, device="cpu")
    with pytest.raises(ValueError, match="attn_metadata"):
        impl.forward_mqa(c["q"], c["kv"], SimpleNamespace(decode=None), layer())
    three = dict(c, q=torch.cat([c["q"], c["q"][:1]]))
    with pytest.raises(ValueError, match="non-uniform decode block"):
        impl.forward_mqa(three["q"], c["kv"], metadata(c), layer())
