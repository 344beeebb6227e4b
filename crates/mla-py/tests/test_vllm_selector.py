"""vLLM 0.33.0's own CUDA attention selector picks ``MlaRsBackend`` from the plugin's CUSTOM slot.

The path is vLLM's, as ``MLAAttention.__init__`` takes it: ``get_attn_backend`` reads the layer's
flags from a real ``VllmConfig`` (DCP, block size, non-causal) and the environment (batch
invariance), then ``CudaPlatform.get_attn_backend_cls`` resolves CUSTOM and asks the class's
``validate_configuration``. Only what a machine without a GPU lacks is stood in: the CUDA platform
module's kernel library ``vllm._C_stable_libtorch`` (it links libcuda) is an empty module where it
cannot load, and the platform's device capability and name are patched.
"""

import importlib
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vLLM 0.33.0 (scripts/vllm/venv.sh)")

import vllm.platforms  # noqa: E402
from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention import selector  # noqa: E402
from vllm.v1.attention.backends import registry  # noqa: E402

from vllm_layer import impl_args  # noqa: E402

# Imported before the CUDA platform becomes the current one: on a CUDA platform, vLLM's attention
# layers module also loads the flash-attention extensions, which a machine without a GPU lacks.
import mla_rs.vllm.backend as backend  # noqa: E402
from mla_rs.vllm import plugin  # noqa: E402
from mla_rs.vllm.backend import MlaRsBackend, MlaRsImpl  # noqa: E402

CACHE_DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KERNELS = "vllm._C_stable_libtorch"
CUSTOM_IS_INVALID = "Selected backend AttentionBackendEnum.CUSTOM is not valid for this configuration. Reason: "


@pytest.fixture(scope="module")
def cuda():
    """vLLM's CUDA platform module; unloaded again afterwards if this module loaded it."""
    loaded = "vllm.platforms.cuda" in sys.modules
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()  # the module's import turns it off
    with pytest.MonkeyPatch.context() as mp:
        try:
            importlib.import_module(KERNELS)
        except ImportError:
            mp.setitem(sys.modules, KERNELS, types.ModuleType(KERNELS))
        yield importlib.import_module("vllm.platforms.cuda")
    if not loaded:
        sys.modules.pop("vllm.platforms.cuda", None)
        vars(vllm.platforms).pop("cuda", None)
    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)


@pytest.fixture(autouse=True)
def registered():
    """The plugin's registration, undone after each test."""
    saved = dict(registry._ATTN_OVERRIDES)
    plugin.register()
    yield
    registry._ATTN_OVERRIDES.clear()
    registry._ATTN_OVERRIDES.update(saved)


@pytest.fixture
def gpu(cuda, monkeypatch):
    """``gpu(major, minor)`` makes vLLM's CUDA platform the current one, on a device of that
    capability, for vLLM and for the backend module (which bound vLLM's platform at import)."""

    def on(major, minor):
        cap = DeviceCapability(major, minor)
        platform_cls = cuda.CudaPlatform
        monkeypatch.setattr(platform_cls, "get_device_capability", classmethod(lambda cls, device_id=0: cap))
        monkeypatch.setattr(platform_cls, "get_device_name", classmethod(lambda cls, device_id=0: f"sm_{major}{minor}"))
        platform = platform_cls()
        monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
        monkeypatch.setattr(backend, "current_platform", platform)
        # vLLM caches each selection for the life of the process (one device): select afresh.
        selector._cached_get_attn_backend.cache_clear()

    yield on
    selector._cached_get_attn_backend.cache_clear()


def config(choice="CUSTOM", per_kind=None, dcp=1, block_size=None, non_causal=False):
    """A real ``VllmConfig`` with the attention choice and the flags the selector reads from it."""
    attention = AttentionConfig(backend=choice, backend_per_kind=per_kind or {}, use_non_causal=non_causal)
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(decode_context_parallel_size=dcp, tensor_parallel_size=dcp),
        cache_config=CacheConfig(block_size=block_size) if block_size else CacheConfig(),
        attention_config=attention,
    )


def select(vllm_config, cache="auto", use_mla=True, head_size=576, window=False, dtype=torch.bfloat16):
    """The backend class vLLM selects for a layer, as ``MLAAttention.__init__`` asks for it."""
    with set_current_vllm_config(vllm_config):
        return selector.get_attn_backend(
            head_size, dtype, cache, use_mla=use_mla, num_heads=16, has_sliding_window=window
        )


def refusal(vllm_config, **layer):
    with pytest.raises(ValueError) as refused:
        select(vllm_config, **layer)
    return str(refused.value)


# ---------------------------------------------------------------- what vLLM accepts


@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_vllm_selects_it_for_an_mla_layer_with_dcp_and_batch_invariance(cache, gpu, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    vllm_config = config(dcp=2)
    gpu(9, 0)
    assert select(vllm_config, cache) is MlaRsBackend
    assert select(vllm_config, cache, dtype=torch.float16) is MlaRsBackend


@pytest.mark.parametrize("block_size", [1, 16, 40, 64])
@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_vllm_selects_it_with_any_block_size_a_sliding_window_and_non_causal(cache, block_size, gpu):
    vllm_config = config(block_size=block_size, non_causal=True)
    assert vllm_config.cache_config.user_specified_block_size
    gpu(9, 0)
    assert select(vllm_config, cache, window=True) is MlaRsBackend


def test_per_kind_selection_gives_it_the_mla_layers(gpu):
    # The per-kind form leaves a model's other attention layers to their own backends.
    vllm_config = config(choice=None, per_kind={"mla_attention": "CUSTOM", "sliding_window_mla": "CUSTOM"})
    gpu(9, 0)
    assert select(vllm_config) is MlaRsBackend
    assert select(vllm_config, window=True) is MlaRsBackend


# ---------------------------------------------------------------- what vLLM refuses, and why


def test_a_non_mla_layer_with_custom_is_refused_with_vllms_message(gpu):
    vllm_config = config()
    gpu(9, 0)
    message = refusal(vllm_config, use_mla=False, head_size=128)
    assert message == CUSTOM_IS_INVALID + "['head_size not supported', 'non-MLA not supported']"


def test_vllm_refuses_what_mla_cannot_run(gpu):
    vllm_config = config()
    gpu(9, 0)
    assert refusal(vllm_config, dtype=torch.float32) == CUSTOM_IS_INVALID + "['dtype not supported']"
    assert refusal(vllm_config, cache="fp8_ds_mla") == CUSTOM_IS_INVALID + "['kv_cache_dtype not supported']"
    # Like vLLM's own Triton MLA: a non-causal draft block is not decoded across DCP ranks.
    both = config(dcp=2, non_causal=True)
    assert refusal(both) == CUSTOM_IS_INVALID + "['non-causal MLA attention with DCP not supported']"


@pytest.mark.parametrize(
    "owner,claim,reason,flag",
    [
        (MlaRsBackend, "supports_batch_invariance", "batch invariance not supported", "batch_invariant"),
        (MlaRsImpl, "supports_dcp", "DCP not supported", dict(dcp=2)),
        (MlaRsBackend, "supports_block_size", "block_size not supported", dict(block_size=40)),
        (MlaRsBackend, "supports_non_causal", "non-causal attention not supported", dict(non_causal=True)),
        (MlaRsBackend, "supports_sliding_window", "sliding window not supported", "window"),
    ],
)
def test_each_accepted_flag_reaches_the_backend(owner, claim, reason, flag, gpu, monkeypatch):
    # Withdrawing the one claim a flag needs turns vLLM's acceptance above into the refusal
    # naming it: the flag really travelled from the configuration to the backend.
    if flag == "batch_invariant":
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    vllm_config = config(**flag) if isinstance(flag, dict) else config()
    gpu(9, 0)
    assert select(vllm_config, window=flag == "window") is MlaRsBackend
    if owner is MlaRsImpl:
        monkeypatch.setattr(owner, claim, False)
    else:
        monkeypatch.setattr(owner, claim, classmethod(lambda cls, *_: False))
    selector._cached_get_attn_backend.cache_clear()
    assert refusal(vllm_config, window=flag == "window") == CUSTOM_IS_INVALID + f"[{reason!r}]"


# ---------------------------------------------------------------- device capability


def construct(cache):
    """The selected class's impl, constructed as ``MLAAttention.__init__`` does next."""
    with set_current_vllm_config(config()):
        return MlaRsBackend.get_impl_cls()(**impl_args(kv_cache_dtype=cache))


def test_below_sm80_vllm_refuses_it(gpu):
    vllm_config = config()
    gpu(7, 5)
    assert refusal(vllm_config) == CUSTOM_IS_INVALID + "['compute capability not supported']"


def test_an_fp8_cache_below_sm89_is_selected_then_refused_with_the_flag_to_use(gpu):
    vllm_config = config()
    gpu(8, 0)
    assert select(vllm_config, "fp8") is MlaRsBackend
    refused = r"on sm_80 \(compute capability 8\.0\).*SM89\+\. Re-run with --kv-cache-dtype bfloat16\."
    with pytest.raises(ValueError, match=refused):
        construct("fp8")
    assert construct("bfloat16").kv_cache_dtype == "bfloat16"


def test_sm86_takes_a_bfloat16_cache_and_sm89_an_fp8_one(gpu):
    vllm_config = config()
    gpu(8, 6)
    assert select(vllm_config, "bfloat16") is MlaRsBackend
    assert construct("bfloat16").supports_quant_query_input is True
    with pytest.raises(ValueError, match="SM89"):
        construct("fp8_e5m2")
    gpu(8, 9)
    assert select(vllm_config, "fp8_e5m2") is MlaRsBackend
    assert construct("fp8_e5m2").supports_quant_query_input is False
