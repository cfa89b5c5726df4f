"""flashlm: FlashAttention-2 kernels (CPU and CUDA) for PyTorch, through flashlm's C ABI.

    flashlm.flash_attn_func(q, k, v, causal=True)               # flash-attn's: [batch, seq, heads, head_dim]
    flashlm.scaled_dot_product_attention(q, k, v, is_causal=True)  # SDPA's: [batch, heads, seq, head_dim]
    flashlm.attention(q, k, v, layout="bshd", causal=True)      # either layout, said explicitly
    flashlm.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)
                                                                # packed sequences: [total, heads, head_dim]
    flashlm.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table, causal=True)
                                                                # decoding over a (paged) KV cache, appended in place
    flashlm.FlashAttention.apply(q, k, v, True)                 # the CS336 interface: (batch, seq, dim), one head
    torch.ops.flashlm.attention_fwd / attention_bwd             # the custom operators (torch >= 2.4)
    torch.ops.flashlm.attention_varlen_fwd / attention_varlen_bwd
    torch.ops.flashlm.attention_with_kvcache                    # mutates k_cache and v_cache
"""
import importlib.util

from ._lib import FlashlmError, FlashlmOutOfMemory, FlashlmValueError
from ._lib import lib as _clib

__version__ = _clib.flashlm_version().decode()

_TORCH_NAMES = ("attention", "flash_attn_func", "scaled_dot_product_attention", "FlashAttention", "attention_forward",
                "attention_backward", "flash_attn_varlen_func", "attention_varlen_forward", "flash_attn_with_kvcache")


def cuda_device_count():
    """CUDA devices libflashlm can use (0 when it was built without CUDA)."""
    return int(_clib.flashlm_cuda_device_count())


if importlib.util.find_spec("torch") is not None:
    # Plain module attributes (no module __getattr__ on the call path), so torch.compile traces
    # flashlm.attention(...) like any function; this also registers torch.ops.flashlm.
    from .torch_ops import (FlashAttention, attention, attention_backward, attention_forward,  # noqa: F401
                            attention_varlen_forward, flash_attn_func, flash_attn_varlen_func,
                            flash_attn_with_kvcache, scaled_dot_product_attention)
else:
    def __getattr__(name):
        if name in _TORCH_NAMES:
            raise ImportError(f"flashlm.{name} needs PyTorch (pip install torch)")
        raise AttributeError(f"module 'flashlm' has no attribute '{name}'")


__all__ = [*_TORCH_NAMES, "cuda_device_count", "FlashlmError", "FlashlmValueError", "FlashlmOutOfMemory", "__version__"]
