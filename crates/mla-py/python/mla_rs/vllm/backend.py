"""mla as a vLLM MLA attention backend (vLLM 0.33.0 and later of the same API).

``MlaRsBackend`` sits on vLLM's ``MLACommonBackend``; ``MlaRsImpl`` on ``MLACommonImpl`` runs the
decode (``forward_mqa``) with mla's kernels and leaves prefill (``forward_mha``) to vLLM's MLA
prefill backend. Select it with the plugin (``mla_rs.vllm.plugin``), which registers it in
vLLM's ``CUSTOM`` slot: ``--attention-backend CUSTOM``, or
``--attention-config.backend_per_kind '{"mla_attention": "CUSTOM"}'`` for a model whose other
attention layers keep their own backend.

Beyond vLLM 0.33.0's Triton MLA class, this one carries what newer vLLM adds: a sliding window
(decode only; a windowed prefill is refused), and ``register_decode_warmup`` — which 0.33.0
never calls, so ``forward_mqa`` calls it for each new cache, before any CUDA-graph capture.
"""

from typing import ClassVar

import torch

import vllm.envs as envs
from vllm.config import get_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    MultipleOf,
    max_decode_query_len,
)
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from .._mla_rs import MlaDecode
from .forward import forward_mqa

BACKEND_NAME = "MLA_RS"
_IMPL_NAME = "MlaRsImpl"


class MlaRsMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    # mla decodes a uniform multi-token block (causal or a non-causal draft block) directly,
    # query_len rows a request, so both take the decode path, CUDA graphs included.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    supports_non_causal_multi_token_decode: ClassVar[bool] = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # DCP local sequence lengths are not advanced between draft steps.
        self.supports_draft_decode_metadata_update = self.dcp_world_size == 1

    def update_draft_decode_metadata(self, _metadata: MLACommonMetadata) -> None:
        pass


class MlaRsBackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
    ]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["MlaRsImpl"]:
        return MlaRsImpl

    @staticmethod
    def get_builder_cls() -> type["MlaRsMetadataBuilder"]:
        return MlaRsMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Any page size: the kernels index pages by the block table and a token by its stride.
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size > 0

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # mla's kernels need sm_80 or newer (mma.sync; wgmma on sm_90a).
        return capability.major >= 8

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True


def _check_device_dtypes(kv_cache_dtype: str) -> None:
    """The seed's refusals of cache dtypes the GPU cannot take, with the suggested flag."""
    if not current_platform.is_cuda():
        return
    cap = current_platform.get_device_capability()
    cap_str = cap.as_version_str() if cap is not None else "unknown"
    dev = current_platform.get_device_name()
    if kv_cache_dtype.startswith("fp8") and not current_platform.has_device_capability(89):
        suggested = "float16" if (cap is None or cap.to_int() < 80) else "bfloat16"
        raise ValueError(
            f"FP8 KV cache is not supported by the {BACKEND_NAME} MLA backend on {dev} (compute capability "
            f"{cap_str}); native FP8 (fp8e4nv) requires SM89+. Re-run with --kv-cache-dtype {suggested}."
        )
    if kv_cache_dtype == "bfloat16" and not current_platform.has_device_capability(80):
        raise ValueError(
            f"bfloat16 KV cache is not supported by the {BACKEND_NAME} MLA backend on {dev} (compute capability "
            f"{cap_str}); bfloat16 requires SM80+. Re-run with --kv-cache-dtype float16."
        )


class MlaRsImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA Specific Arguments
        **mla_args,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        if any([alibi_slopes, logits_soft_cap]):
            raise NotImplementedError(
                f"{_IMPL_NAME} does not support one of the following: alibi_slopes, logits_soft_cap"
            )
        # Each decode row attends to the last `decode_sliding_window` keys.
        self.decode_sliding_window = sliding_window
        if sliding_window is not None and self.dcp_world_size > 1:
            raise NotImplementedError(
                f"Sliding-window {BACKEND_NAME} MLA does not support decode context parallelism"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"Encoder self-attention and encoder/decoder cross-attention are not implemented for {_IMPL_NAME}"
            )
        _check_device_dtypes(self.kv_cache_dtype)
        # An fp8 cache is dequantized on load and read with the model-dtype query: tell the
        # common layer not to quantize q to fp8.
        if is_quantized_kv_cache(self.kv_cache_dtype):
            self.supports_quant_query_input = False

        self._vllm_config = get_current_vllm_config()
        model = self._vllm_config.model_config
        self._model_dtype = model.dtype if model is not None else None
        device = self._vllm_config.device_config
        self._device = str(device.device) if device is not None and device.device is not None else None
        # One decoder for each setting of vLLM's batch-invariant mode (read at each call, as
        # vLLM's own kernels do), made on first use.
        self._decoders: dict[bool, MlaDecode] = {}
        self._warm_cache = None

    # ------------------------------------------------------------------ decoders and scratch

    def _decoder(self, dtype=None) -> MlaDecode:
        invariant = bool(envs.VLLM_BATCH_INVARIANT)
        dec = self._decoders.get(invariant)
        if dec is None:
            dec = MlaDecode(
                self.num_heads,
                float(self.scale),
                kv_cache_dtype=self.kv_cache_dtype,
                kv_lora_rank=self.kv_lora_rank,
                qk_rope_head_dim=self.qk_rope_head_dim,
                sliding_window=self.decode_sliding_window,
                batch_invariant=invariant,
                dtype=self._model_dtype or dtype,
                dcp_world_size=self.dcp_world_size,
                device=self._device,
            )
            self._decoders[invariant] = dec
            self._reserve(dec)
        return dec

    def _reserve(self, dec: MlaDecode) -> None:
        """Scratch for the worst case the config allows: max_num_seqs x the widest decode
        query rows, over max_model_len keys (mla clamps it to the window)."""
        config = self._vllm_config
        if config.model_config is None:
            return  # nothing to size from: the first forward reserves for its max_seq_len
        rows = config.scheduler_config.max_num_seqs * max_decode_query_len(config)
        dec.reserve_workspace(rows, config.model_config.max_model_len)

    def reserve_workspace(self) -> None:
        # vLLM calls this in its memory-profiling run, so the KV cache is sized around it.
        self._decoder()

    def forward_mha(self, *args, **kwargs) -> None:
        if self.decode_sliding_window is not None:
            # Windowed drafts only run non-causal decode blocks.
            raise NotImplementedError(f"Sliding-window {BACKEND_NAME} MLA prefill")
        return super().forward_mha(*args, **kwargs)

    def register_decode_warmup(self, kv_cache: torch.Tensor, kv_cache_dtype: str) -> list[int]:
        """Builds (compiles with NVRTC or reads from the disk cache) and loads every kernel
        forward_mqa can pick for this bound cache: its dtype, page size and strides, each split
        count up to max_model_len (clamped to the window; only 1 in batch-invariant mode).
        Returns the split counts covered (none when nothing is reserved to size them)."""
        dec = self._decoder()
        if dec.reserved_model_len is None:
            return []
        return dec.register_decode_warmup(kv_cache, kv_cache_dtype)

    # ------------------------------------------------------------------ decode

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        first = q[0] if isinstance(q, tuple) else q
        dec = self._decoder(first.dtype)
        cache = kv_c_and_k_pe_cache
        key = (cache.data_ptr(), cache.shape, cache.stride())
        if key != self._warm_cache:
            self.register_decode_warmup(cache, self.kv_cache_dtype)
            self._warm_cache = key
        return forward_mqa(dec, q, cache, attn_metadata, layer._k_scale)
