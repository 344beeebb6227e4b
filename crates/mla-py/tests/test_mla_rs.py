"""mla_rs against a torch float64 reference, on CPU tensors (the CPU backend) and on the GPU;
its import and argument errors anywhere.

Tests that need torch skip without it; GPU tests skip (with the reason) where a CUDA device is
missing. Outputs are poisoned with NaN before every run, and every case draws fresh random inputs.
"""

import pytest

import mla_rs

try:
    import torch
except ImportError:  # the import and error tests still run
    torch = None

HAS_GPU = torch is not None and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs torch with a CUDA device")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
# The reference tests run on CPU tensors everywhere and on CUDA tensors where there is a GPU.
DEVICES = ["cpu", "cuda"] if HAS_GPU else ["cpu"]

D, L, R = 576, 512, 64
SCALE = 192**-0.5
O_TOL, LSE_TOL = 5e-3, 1e-3
if torch is not None:
    from reference import assert_close, make_case, poisoned, reference


# ---------------------------------------------------------------- anywhere


def test_imports_and_reports_its_version():
    assert mla_rs.__version__
    dec = mla_rs.MlaDecode(16, SCALE)
    assert "num_heads=16" in repr(dec)
    assert dec.workspace_bytes == 0


def test_configuration_errors_use_the_library_messages():
    with pytest.raises(ValueError, match='unknown name "fp4"'):
        mla_rs.MlaDecode(16, SCALE, kv_cache_dtype="fp4")
    with pytest.raises(NotImplementedError, match="fp8_ds_mla is not supported by mla yet"):
        mla_rs.MlaDecode(16, SCALE, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="num_heads"):
        mla_rs.MlaDecode(0, SCALE)
    with pytest.raises(NotImplementedError, match="decode context parallelism"):
        mla_rs.MlaDecode(16, SCALE, sliding_window=128, dcp_world_size=2)
    with pytest.raises(ValueError, match="the fp8-query mode needs an fp8 kv cache"):
        mla_rs.MlaDecode(16, SCALE, kv_cache_dtype="bfloat16", fp8_query=True)
    assert "fp8_query=True" in repr(mla_rs.MlaDecode(16, SCALE, kv_cache_dtype="fp8", fp8_query=True))


def test_the_drop_in_refuses_what_is_not_mla():
    with pytest.raises(NotImplementedError, match="MLA case only"):
        mla_rs.decode_attention_fwd(None, None, None, None, None, None, None, None, 4, SCALE)
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        mla_rs.decode_attention_fwd(None, None, None, None, None, None, None, None, 4, SCALE, logit_cap=30.0, is_mla=True)


def test_the_drop_in_compares_scales_without_reading_them_when_it_can():
    from mla_rs.vllm import _same_scale

    scale = object()  # the same object is one scale, whatever it is: nothing is read
    assert _same_scale(scale, scale)
    assert _same_scale(0.5, 0.5)
    assert not _same_scale(0.5, 0.25)


@pytest.mark.skipif(HAS_GPU, reason="checks the message on machines without a GPU")
def test_a_gpu_call_without_a_gpu_says_so():
    # With torch installed and no driver, mla's message, not torch's.
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        mla_rs.MlaDecode(16, SCALE).reserve_workspace(4, 1024)
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        mla_rs.MlaDecode(16, SCALE, device="cuda").reserve_workspace(4, 1024)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: mla_rs.MlaDecode(-16, SCALE), "num_heads"),
        (lambda: mla_rs.MlaDecode(16, SCALE, sliding_window=-1), "sliding_window"),
        (lambda: mla_rs.MlaDecode(16, SCALE, kv_lora_rank=-512), "kv_lora_rank"),
        (lambda: mla_rs.MlaDecode(16, SCALE, dcp_world_size=-2), "dcp_world_size"),
        (lambda: mla_rs.MlaDecode(16, SCALE, device="cpu").reserve_workspace(-4, 1024), "max_rows"),
        (lambda: mla_rs.MlaDecode(16, SCALE, device="cpu").reserve_workspace(4, -1024), "max_model_len"),
        (lambda: mla_rs.MlaDecode(16, SCALE, device="tpu"), "device"),
    ],
)
def test_negative_counts_are_value_errors_that_name_the_argument(make, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        make()


def test_a_cpu_decoder_reserves_without_a_gpu():
    dec = mla_rs.MlaDecode(16, SCALE, device="cpu")
    dec.reserve_workspace(4, 8192)
    assert dec.reserved_model_len == 8192
    assert dec.workspace_bytes > 0
    assert "device=the host" in repr(dec)


# ---------------------------------------------------------------- on the GPU

CASES = [
    # (heads, page, lens, kv, q dtype, query_len, causal, window, split q)
    (16, 64, [700, 1500, 33, 0], "bf16", "bf16", 1, True, None, False),
    (128, 64, [4096, 1000], "bf16", "bf16", 1, True, None, True),
    (16, 16, [900, 5, 0], "fp8", "bf16", 1, True, None, False),
    (16, 16, [900, 5], "fp8_u8", "bf16", 1, True, None, False),
    (32, 1, [300, 1200], "fp8_e5m2", "f16", 2, False, None, False),
    (16, 64, [3000, 2, 400], "f16", "f16", 3, True, None, True),
    (64, 33, [2000, 77], "bf16", "bf16", 4, True, 100, False),
    (20, 3, [1000, 10, 257], "bf16", "bf16", 1, True, 64, False),
]


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,page,lens,kv,qd,query_len,causal,window,split_q", CASES)
def test_matches_the_reference(heads, page, lens, kv, qd, query_len, causal, window, split_q, device):
    q_dtype = torch.bfloat16 if qd == "bf16" else torch.float16
    c = make_case(len(lens), heads, lens, page, kv=kv, q_dtype=q_dtype, query_len=query_len, seed=heads + page,
                  device=device)
    cache_dtype = {"bf16": "bfloat16", "f16": "float16", "fp8": "fp8", "fp8_u8": "fp8", "fp8_e5m2": "fp8_e5m2"}[kv]
    dec = mla_rs.MlaDecode(heads, SCALE, kv_cache_dtype=cache_dtype, sliding_window=window, dtype=q_dtype)
    q = (c["q"][..., :L], c["q"][..., L:]) if split_q else c["q"]
    o, lse = poisoned(c, heads)
    dec.forward(q, c["kv"], c["block_table"], c["seq_lens"], k_scale=c["k_scale"], query_len=query_len,
                causal=causal, out=o, lse_out=lse)
    dec.check_device_errors()
    assert_close(o, lse, *reference(c, causal=causal, window=window))


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_allocates_its_outputs_when_none_are_given(device):
    c = make_case(3, 16, [100, 2000, 1], 64, device=device)
    o, lse = mla_rs.MlaDecode(16, SCALE).forward(c["q"], c["kv"], c["block_table"], c["seq_lens"])
    assert o.dtype == torch.bfloat16 and o.shape == (3, 16, L) and lse.dtype == torch.float32
    assert o.device.type == device
    assert_close(o, lse, *reference(c))


@needs_torch
def test_a_cpu_output_that_overlaps_an_input_is_refused():
    c = make_case(2, 16, [100, 20], 16, device="cpu")
    dec = mla_rs.MlaDecode(16, SCALE)
    o, lse = poisoned(c, 16)
    inside_o = o.view(torch.float32).view(-1)[:32].view(2, 16)  # o's own first bytes
    with pytest.raises(ValueError, match="lse_out: overlaps"):
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], out=o, lse_out=inside_o)
    with pytest.raises(ValueError, match="out: overlaps"):
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], out=c["q"][..., :L], lse_out=lse)


@needs_torch
def test_the_max_seq_len_hint_sizes_the_scratch_without_reading_the_lengths():
    c = make_case(2, 16, [700, 20], 16, device="cpu")
    dec = mla_rs.MlaDecode(16, SCALE)
    o, lse = poisoned(c, 16)
    dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], out=o, lse_out=lse, max_seq_len=1024)
    assert dec.reserved_model_len == 1024
    assert_close(o, lse, *reference(c))
    with pytest.raises(ValueError, match="max_seq_len: expected a value >= 0"):
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], max_seq_len=-1)


@needs_torch
def test_an_fp8_cache_handed_as_e4m3_is_read_as_the_configured_e5m2():
    # vLLM views every fp8 cache as e4m3 whatever the dtype string: the decoder's own cache
    # dtype decides how the bytes are read.
    c = make_case(2, 16, [300, 41], 16, kv="fp8_e5m2", device="cpu")
    dec = mla_rs.MlaDecode(16, SCALE, kv_cache_dtype="fp8_e5m2")
    o, lse = poisoned(c, 16)
    dec.forward(c["q"], c["kv"].view(torch.float8_e4m3fn), c["block_table"], c["seq_lens"], k_scale=c["k_scale"],
                out=o, lse_out=lse)
    assert_close(o, lse, *reference(c))


@needs_gpu
@pytest.mark.parametrize("query_len,device_schedule", [(2, False), (1, True)])
def test_replays_a_captured_graph_with_new_lengths(query_len, device_schedule):
    # Single tokens with device_schedule: the GPU recomputes the schedule at each replay.
    c = make_case(3, 64, [4000, 4000, 4000], 16, query_len=query_len)
    dec = mla_rs.MlaDecode(64, SCALE, device_schedule=device_schedule)
    dec.reserve_workspace(3 * query_len, 8192)
    dec.lock_workspace()
    dec.register_decode_warmup(c["kv"], "auto")
    o, lse = poisoned(c, 64)
    seq_lens = c["seq_lens"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.forward(c["q"], c["kv"], c["block_table"], seq_lens, query_len=query_len, out=o, lse_out=lse)
    for lens in ([1000, 300, 4000], [1, 0, 2500], [4000, 4000, 17]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        c["block_table"].copy_(c["block_table"][torch.randperm(3, device="cuda")])
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        dec.check_device_errors()
        case = dict(c, seq_lens=seq_lens)
        assert_close(o, lse, *reference(case), what=str(lens))


@needs_gpu
def test_a_graph_reads_a_new_k_scale_tensor():
    c = make_case(2, 16, [3000, 700], 64, kv="fp8")
    k_scale = torch.tensor([0.5], dtype=torch.float32, device="cuda")
    dec = mla_rs.MlaDecode(16, SCALE, kv_cache_dtype="fp8")
    dec.reserve_workspace(2, 4096)
    dec.lock_workspace()
    dec.register_decode_warmup(c["kv"], "fp8")
    o, lse = poisoned(c, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], k_scale=k_scale, out=o, lse_out=lse)
    for k in (0.5, 0.125):
        k_scale.fill_(k)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        deq = (c["kv"].float() * k).to(torch.bfloat16).float()
        assert_close(o, lse, *reference(c, deq=deq), what=f"k_scale {k}")


@needs_gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_the_fp8_query_mode(heads):
    # Against exact attention with the mode's tolerances (docs/contract.md: q and P rounded to
    # e4m3, about 3e-2), and against the exact attention of the quantized q, which it must be
    # closer to: the mode quantizes q as e4m3(q / q_scale).
    c = make_case(3, heads, [3000, 700, 1], 64, kv="fp8")
    dec = mla_rs.MlaDecode(heads, SCALE, kv_cache_dtype="fp8", fp8_query=True)
    exact = reference(c)
    for q_scale in (1 / 64, torch.tensor([0.01], dtype=torch.float32, device="cuda")):
        o, lse = poisoned(c, heads)
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], k_scale=c["k_scale"], q_scale=q_scale,
                    out=o, lse_out=lse)
        dec.check_device_errors()
        assert_close(o, lse, *exact, what=f"q_scale {q_scale}", o_tol=5e-2, lse_tol=0.15)
        s = float(q_scale)
        # torch's cast does not saturate: clamp to e4m3's largest value first, as the mode does.
        q8 = ((c["q"].float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
        quantized = reference(dict(c, q=q8))
        to = lambda ref: float((o.double() - ref[0]).norm() / ref[0].norm())
        assert to(quantized) < to(exact), f"q_scale {q_scale}"
    with pytest.raises(ValueError, match="q_scale: expected a finite value > 0, got 0"):
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], k_scale=c["k_scale"], q_scale=0.0)


@needs_gpu
def test_runs_on_torchs_current_stream():
    c = make_case(4, 16, [5000, 17, 900, 3000], 64)
    dec = mla_rs.MlaDecode(16, SCALE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o, lse = poisoned(c, 16)
        dec.forward(c["q"], c["kv"], c["block_table"], c["seq_lens"], out=o, lse_out=lse)
    side.synchronize()
    assert_close(o, lse, *reference(c))


@needs_gpu
@pytest.mark.parametrize("kv,lse_dtype", [("bf16", torch.bfloat16), ("fp8_u8", torch.float32)] if HAS_GPU else [])
def test_the_vllm_drop_in_matches_mla_decode(kv, lse_dtype):
    c = make_case(5, 16, [700, 1, 3000, 0, 64], 64, kv=kv)
    rows, heads = 5, 16
    k_buffer = c["kv"].unsqueeze(2)  # vLLM's [blocks, page, 1, 576]
    v_buffer = k_buffer[..., :L]
    o = torch.full((rows, heads, L), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((rows, heads), float("nan"), dtype=lse_dtype, device="cuda")
    splits = 8
    attn_logits = torch.empty(rows, heads, splits, L + 1, dtype=torch.float32, device="cuda")
    k_scale = torch.tensor([c["k_scale"]], dtype=torch.float32, device="cuda")
    mla_rs.decode_attention_fwd(c["q"], k_buffer, v_buffer, o, lse, c["block_table"], c["seq_lens"], attn_logits,
                                splits, SCALE, page_size=64, k_scale=k_scale, v_scale=k_scale, is_mla=True)
    ref_o, ref_lse = reference(c)
    cache_dtype = "fp8" if kv.startswith("fp8") else "auto"
    o2, lse2 = mla_rs.MlaDecode(heads, SCALE, kv_cache_dtype=cache_dtype).forward(
        c["q"], c["kv"], c["block_table"], c["seq_lens"], k_scale=c["k_scale"])
    assert_close(o2, lse2, ref_o, ref_lse)
    rel = float((o.double() - o2.double()).norm() / o2.double().norm())
    assert rel <= O_TOL, rel
    finite = torch.isfinite(ref_lse)
    tol = 0.05 if lse_dtype == torch.bfloat16 else LSE_TOL  # bf16 holds about 3 digits
    assert float((lse.double()[finite] - ref_lse[finite]).abs().max()) <= tol
    assert torch.equal(torch.isfinite(lse), finite)


@needs_gpu
def test_argument_errors_name_the_argument():
    c = make_case(2, 16, [100, 40], 16)
    # On the GPU from the start (left to the first call, a CPU q would make it a CPU decoder
    # and the CUDA cache the argument in the wrong place).
    dec = mla_rs.MlaDecode(16, SCALE, device="cuda")
    args = [c["q"], c["kv"], c["block_table"], c["seq_lens"]]

    def call(i, value, **kw):
        a = list(args)
        a[i] = value
        return dec.forward(*a, **kw)

    with pytest.raises(ValueError, match="q: expected a tensor on cuda:0 .*, got one on cpu"):
        call(0, c["q"].cpu())
    # The library's own device check names devices as torch does too.
    with pytest.raises(ValueError, match="block_table: expected a tensor on cuda:0, got one on cpu"):
        call(2, c["block_table"].cpu())
    with pytest.raises(ValueError, match="q: expected dtype bf16, got f32"):
        call(0, c["q"].float())
    with pytest.raises(ValueError, match=r"q: expected shape \[rows, 16, 576\]"):
        call(0, c["q"][:, :8])
    wide = torch.zeros(2, 16, 2 * D, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="q: the last dimension must be contiguous"):
        call(0, wide[..., ::2])
    with pytest.raises(ValueError, match=r"block_table: expected shape \[2, max_blocks\]"):
        call(2, c["block_table"][:1])
    with pytest.raises(ValueError, match="seq_lens: dtype torch.int64 is not one mla reads"):
        call(3, c["seq_lens"].long())
    with pytest.raises(ValueError, match="seq_lens: expected dtype i32, got f32"):
        call(3, c["seq_lens"].float())
    with pytest.raises(ValueError, match="kv_cache: expected a 3-dimensional tensor"):
        call(1, c["kv"].unsqueeze(2))
    three = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda")
    table3 = torch.cat([c["block_table"], c["block_table"][:1]])
    with pytest.raises(ValueError, match=r"block_table: expected shape \[3, max_blocks\]"):
        call(3, three)
    with pytest.raises(ValueError, match="non-uniform decode block: 2 query rows over 3 requests"):
        dec.forward(c["q"], c["kv"], table3, three)
    out = torch.empty(2, 16, L, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="o: expected dtype bf16, got f16"):
        dec.forward(*args, out=out)


def test_nvrtc_is_loaded_from_its_wheel_without_torch_or_ld_library_path():
    import os
    import subprocess
    import sys

    from mla_rs import _nvrtc

    if _nvrtc.wheel_path() is None:
        pytest.skip("the nvidia-cuda-nvrtc wheel is not installed here")
    code = (
        "import sys, mla_rs; maps = open('/proc/self/maps').read(); "
        "print(mla_rs._nvrtc.wheel_path() in maps, 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_precompile_names_a_bad_architecture():
    with pytest.raises(ValueError, match="arch"):
        mla_rs.precompile(["sm_x"])


def test_python_m_mla_rs_precompile_reports_a_bad_architecture_and_exits_2():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "mla_rs", "precompile", "--arch", "nonsense"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r
    assert "arch" in r.stderr
