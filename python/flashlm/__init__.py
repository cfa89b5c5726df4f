"""flashlm: FlashAttention-2 kernels (CPU and CUDA) for PyTorch, through flashlm's C ABI.

    flashlm.attention(q, k, v, causal=True)     # autograd-aware, [batch, seq, heads, head_dim]
    flashlm.FlashAttention.apply(q, k, v, True) # the CS336 interface: 3-D (batch, seq, dim), one head
"""
from ._lib import FlashlmError, FlashlmOutOfMemory, FlashlmValueError
from ._lib import lib as _clib

__version__ = _clib.flashlm_version().decode()


def cuda_device_count():
    """CUDA devices libflashlm can use (0 when it was built without CUDA)."""
    return int(_clib.flashlm_cuda_device_count())


def __getattr__(name):
    # The torch functions import torch only when used, so the package loads without it.
    if name in ("attention", "FlashAttention", "attention_forward", "attention_backward"):
        from . import torch_ops
        return getattr(torch_ops, name)
    raise AttributeError(f"module 'flashlm' has no attribute '{name}'")


__all__ = ["attention", "FlashAttention", "attention_forward", "attention_backward", "cuda_device_count",
           "FlashlmError", "FlashlmValueError", "FlashlmOutOfMemory", "__version__"]
