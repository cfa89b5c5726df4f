"""Loads libflashlm.so and declares its C ABI (include/flashlm/flashlm.h) for ctypes."""
import ctypes
import os
from pathlib import Path

ABI_VERSION = 1
MAX_DIMS = 6

OK, INVALID_ARGUMENT, OUT_OF_MEMORY, RUNTIME_ERROR = 0, 1, 2, 3
FP64, FP32, FP16, BF16 = 0, 1, 2, 3
CPU, CUDA = 0, 1
TOP_LEFT, BOTTOM_RIGHT = 0, 1
FLASH, NAIVE = 0, 1


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("ndim", ctypes.c_int32), ("dtype", ctypes.c_int32),
                ("device", ctypes.c_int32), ("sizes", ctypes.c_int64 * MAX_DIMS),
                ("strides", ctypes.c_int64 * MAX_DIMS)]


class AttentionOptions(ctypes.Structure):
    _fields_ = [("impl", ctypes.c_int32), ("causal", ctypes.c_int32), ("causal_align", ctypes.c_int32),
                ("deterministic", ctypes.c_int32), ("has_scale", ctypes.c_int32), ("scale", ctypes.c_double),
                ("stream", ctypes.c_void_p)]


class FlashlmError(RuntimeError):
    """A flashlm call failed for a reason other than its arguments (a CUDA error, say)."""


class FlashlmValueError(ValueError):
    """A flashlm call rejected its arguments; the message names the argument and what was expected."""


class FlashlmOutOfMemory(MemoryError):
    """flashlm could not allocate a workspace."""


def _candidates():
    env = os.environ.get("FLASHLM_LIBRARY")
    if env:
        yield Path(env)
        return
    yield Path(__file__).resolve().parent / "lib" / "libflashlm.so"


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError("flashlm: libflashlm.so not found (tried " + ", ".join(tried) + "). Build it with "
                          "scripts/build.sh and set FLASHLM_LIBRARY=/path/to/build/src/libflashlm.so, or copy it "
                          "into flashlm/lib/ before pip install.")
    lib.flashlm_abi_version.restype = ctypes.c_int32
    if lib.flashlm_abi_version() != ABI_VERSION:
        raise ImportError(f"flashlm: {tried[-1]} has C ABI version {lib.flashlm_abi_version()}, "
                          f"this package needs {ABI_VERSION}")
    tp = ctypes.POINTER(Tensor)
    op = ctypes.POINTER(AttentionOptions)
    lib.flashlm_attention_forward.argtypes = [tp, tp, tp, tp, tp, op]
    lib.flashlm_attention_forward.restype = ctypes.c_int
    lib.flashlm_attention_backward.argtypes = [tp] * 9 + [op]
    lib.flashlm_attention_backward.restype = ctypes.c_int
    lib.flashlm_last_error.restype = ctypes.c_char_p
    lib.flashlm_version.restype = ctypes.c_char_p
    lib.flashlm_cuda_built.restype = ctypes.c_int32
    lib.flashlm_cuda_device_count.restype = ctypes.c_int32
    return lib


lib = _load()


def check(status):
    """Raises the Python exception for a failed call's status, with the library's message."""
    if status == OK:
        return
    message = lib.flashlm_last_error().decode()
    if status == INVALID_ARGUMENT:
        raise FlashlmValueError(message)
    if status == OUT_OF_MEMORY:
        raise FlashlmOutOfMemory(message)
    raise FlashlmError(message)
