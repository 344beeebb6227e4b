"""mla_rs: Multi-head Latent Attention decode (DeepSeek-V2/V3/R1) over a paged latent KV cache.

The Rust library mla, for PyTorch tensors: ``MlaDecode`` decodes on a tensor's CUDA device, on
torch's current stream, in PyTorch's own CUDA context; ``decode_attention_fwd`` is a drop-in
for vLLM's Triton MLA kernel entry point; ``mla_rs.ops`` has the decode as a torch custom op
(torch.compile), ``mla_rs.vllm.backend`` the vLLM attention backend. CPU tensors run on the
CPU backend. The module imports without torch and without a GPU; a GPU call made there raises
``RuntimeError: no usable CUDA device: ...``.

    import torch, mla_rs
    dec = mla_rs.MlaDecode(num_heads=16, scale=192 ** -0.5)
    o, lse = dec.forward(q, kv_cache, block_table, seq_lens)

See the README of the mla repository for the shapes and the contract.
"""

from . import _nvrtc

_nvrtc.preload()  # before the extension first compiles a kernel

from ._mla_rs import MlaDecode, __version__, precompile  # noqa: E402
from .vllm import decode_attention_fwd  # noqa: E402

__all__ = ["MlaDecode", "decode_attention_fwd", "precompile", "__version__"]
