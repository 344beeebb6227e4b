from typing import Any, Optional, Sequence, Tuple, Union

__version__: str

def precompile(
    arch: Sequence[str] = ..., use_cache: bool = ...
) -> Sequence[Tuple[str, str, str, Optional[int], Optional[int], bool]]:
    """Build every GPU kernel ahead of time into the disk cache (``MLA_CACHE_DIR``, else
    ``~/.cache/mla``), as ``mla precompile`` does.

    On CUDA device 0 when ``arch`` is empty, else for each named architecture (``"sm_80"``,
    ``"sm_90a"``, ...) without a device (libnvrtc is enough). ``use_cache=False`` compiles every
    kernel afresh so that each reports its registers and spills. Returns one tuple per kernel:
    ``(arch, kernel, defines, registers or None, spilled bytes or None, from_cache)``.
    Raises ``RuntimeError`` without NVRTC or a device, ``ValueError`` for a bad ``arch``.
    """

class MlaDecode:
    """MLA decode over a paged latent KV cache on the tensors' CUDA device or the CPU backend."""

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_cache_dtype: str = "auto",
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        sliding_window: Optional[int] = None,
        batch_invariant: bool = False,
        dtype: Any = None,
        dcp_world_size: int = 1,
        device_schedule: bool = False,
        fp8_query: bool = False,
        device: Union[str, Any, None] = None,
    ) -> None: ...
    def reserve_workspace(self, max_rows: int, max_model_len: int) -> None: ...
    @property
    def reserved_model_len(self) -> Optional[int]: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def q_heads(self) -> int: ...
    def lock_workspace(self) -> None: ...
    def register_decode_warmup(self, kv_cache: Any, kv_cache_dtype: str) -> Sequence[int]: ...
    def forward(
        self,
        q: Union[Any, Tuple[Any, Any]],
        kv_cache: Any,
        block_table: Any,
        seq_lens: Any,
        *,
        k_scale: Union[float, Any, None] = None,
        q_scale: Union[float, Any, None] = None,
        query_len: int = 1,
        causal: bool = True,
        out: Optional[Any] = None,
        lse_out: Optional[Any] = None,
        max_seq_len: Optional[int] = None,
    ) -> Tuple[Any, Any]: ...
    def check_device_errors(self) -> None: ...
    @property
    def workspace_bytes(self) -> int: ...
