"""Loads libflashlm and declares its C ABI (include/flashlm/flashlm.h) for ctypes.

A call's tensors and options are packed by struct.pack_into into a buffer laid out as the header's
flashlm_tensor / flashlm_attention_options structs, and the C functions get addresses into it: no ctypes
structure is built per call (that cost ~60 µs of host time per attention call). The buffers are kept per
thread and per call geometry (PackedCall), so a repeated call rewrites only its data pointers and stream.
"""
import ctypes
import os
import struct
import threading
from pathlib import Path

ABI_VERSION = 6
MAX_DIMS = 6

OK, INVALID_ARGUMENT, OUT_OF_MEMORY, RUNTIME_ERROR = 0, 1, 2, 3
FP64, FP32, FP16, BF16, FP8_E4M3 = 0, 1, 2, 3, 4
CPU, CUDA = 0, 1
TOP_LEFT, BOTTOM_RIGHT = 0, 1
FLASH, NAIVE = 0, 1

# flashlm_tensor: void* data; int32 ndim, dtype, device; (4 bytes of padding) int64 sizes[6], strides[6].
# Attention tensors have 4 dimensions (lse 3); packed varlen ones 3 (lse 2); the unused sizes and strides are zero padding.
TENSOR4 = "Qiii4x4q16x4q16x"
TENSOR3 = "Qiii4x3q24x3q24x"
TENSOR2 = "Qiii4x2q32x2q32x"
# The options' tensors (alibi_slopes, learnable_sink, dlearnable_sink: [heads_q] or [batch, heads_q]; the per-head
# descales: [batch, heads_k]): any ndim <= 6, sizes and strides padded to 6.
TENSOR_ANY = "Qiii4x6q6q"
TENSOR_BYTES = 120
# flashlm_attention_options: int32 impl, causal, causal_align, deterministic, has_scale; double scale;
# float q_descale, k_descale, v_descale; void* stream; int64 window_size_left, window_size_right; double softcap;
# const flashlm_tensor* alibi_slopes, learnable_sink, dlearnable_sink, q_descale_heads, k_descale_heads,
# v_descale_heads (0: none; the last three since ABI 6).
OPTIONS = "iiiii4xdfff4xQqqdQQQQQQ"
OPTIONS_BYTES = 128
# flashlm_varlen: const int32* cu_seqlens_q, cu_seqlens_k; int64 batch; int32 device; int64 max_seqlen_q,
# max_seqlen_k.
VARLEN = "QQqi4xqq"
VARLEN_BYTES = 48
# forward(q, k, v, o, lse, options) and backward(q, k, v, o, lse, dout, dq, dk, dv, options); the varlen
# calls take their packed tensors and the flashlm_varlen before the options.
FORWARD = struct.Struct("=" + TENSOR4 * 4 + TENSOR3 + OPTIONS)
BACKWARD = struct.Struct("=" + TENSOR4 * 4 + TENSOR3 + TENSOR4 * 4 + OPTIONS)
VARLEN_FORWARD = struct.Struct("=" + TENSOR3 * 4 + TENSOR2 + VARLEN + OPTIONS)
VARLEN_BACKWARD = struct.Struct("=" + TENSOR3 * 4 + TENSOR2 + TENSOR3 * 4 + VARLEN + OPTIONS)
assert FORWARD.size == 5 * TENSOR_BYTES + OPTIONS_BYTES and BACKWARD.size == 9 * TENSOR_BYTES + OPTIONS_BYTES
assert VARLEN_FORWARD.size == FORWARD.size + VARLEN_BYTES and VARLEN_BACKWARD.size == BACKWARD.size + VARLEN_BYTES
# The six tensors the options may point at, packed after a call's arguments (call_with_extras).
EXTRA_TENSORS = 6
EXTRAS = struct.Struct("=" + TENSOR_ANY * EXTRA_TENSORS)
assert struct.calcsize("=" + TENSOR_ANY) == TENSOR_BYTES
NO_TENSOR = (0, 0, 0, 0) + (0,) * 12
# The byte offsets of each C argument in a packed call: the tensors, then (varlen) the flashlm_varlen, the options.
FORWARD_ARGS = tuple(i * TENSOR_BYTES for i in range(6))
BACKWARD_ARGS = tuple(i * TENSOR_BYTES for i in range(10))
VARLEN_FORWARD_ARGS = (*(i * TENSOR_BYTES for i in range(5)), 5 * TENSOR_BYTES, 5 * TENSOR_BYTES + VARLEN_BYTES)
VARLEN_BACKWARD_ARGS = (*(i * TENSOR_BYTES for i in range(9)), 9 * TENSOR_BYTES, 9 * TENSOR_BYTES + VARLEN_BYTES)
# flashlm_kvcache_index: const int32* cache_seqlens, block_table; int64 max_pages, block_table_stride.
KVCACHE_INDEX = "QQqq"
KVCACHE_INDEX_BYTES = 32
# with_kvcache(q, k_cache, v_cache, k_new, v_new, o, lse, index, options): k_new, v_new and lse may be absent,
# their slots then packed as zeros and passed as NULL.
KVCACHE = struct.Struct("=" + TENSOR4 * 6 + TENSOR3 + KVCACHE_INDEX + OPTIONS)
assert KVCACHE.size == 7 * TENSOR_BYTES + KVCACHE_INDEX_BYTES + OPTIONS_BYTES


class FlashlmError(RuntimeError):
    """A flashlm call failed for a reason other than its arguments (a CUDA error, say)."""


class FlashlmValueError(ValueError):
    """A flashlm call rejected its arguments; the message names the argument and what was expected."""


class FlashlmOutOfMemory(MemoryError):
    """flashlm could not allocate a workspace."""


LIBRARY_NAMES = ("libflashlm_attention.so", "libflashlm.so")


def _candidates():
    env = os.environ.get("FLASHLM_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    for name in LIBRARY_NAMES:
        yield here / "lib" / name


def _load():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise ImportError("flashlm: needs a 64-bit Python")
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError("flashlm: the attention library was not found (tried " + ", ".join(tried) + "). "
                          "Install the package from the repository (pip install ./python builds it), or build "
                          "it with CMake and set FLASHLM_LIBRARY=/path/to/libflashlm_attention.so.")
    lib.flashlm_abi_version.restype = ctypes.c_int32
    if lib.flashlm_abi_version() != ABI_VERSION:
        raise ImportError(f"flashlm: {tried[-1]} has C ABI version {lib.flashlm_abi_version()}, "
                          f"this package needs {ABI_VERSION}")
    lib.flashlm_attention_forward.argtypes = [ctypes.c_void_p] * 6
    lib.flashlm_attention_forward.restype = ctypes.c_int
    lib.flashlm_attention_backward.argtypes = [ctypes.c_void_p] * 10
    lib.flashlm_attention_backward.restype = ctypes.c_int
    lib.flashlm_attention_varlen_forward.argtypes = [ctypes.c_void_p] * 7
    lib.flashlm_attention_varlen_forward.restype = ctypes.c_int
    lib.flashlm_attention_varlen_backward.argtypes = [ctypes.c_void_p] * 11
    lib.flashlm_attention_varlen_backward.restype = ctypes.c_int
    lib.flashlm_attention_with_kvcache.argtypes = [ctypes.c_void_p] * 9
    lib.flashlm_attention_with_kvcache.restype = ctypes.c_int
    lib.flashlm_last_error.restype = ctypes.c_char_p
    lib.flashlm_version.restype = ctypes.c_char_p
    lib.flashlm_cuda_built.restype = ctypes.c_int32
    lib.flashlm_cuda_device_count.restype = ctypes.c_int32
    return lib


lib = _load()
path = lib._name


class PackedCall:
    """One call's C arguments packed in a buffer of their own (FORWARD's or BACKWARD's layout) and their
    addresses. A call whose shapes, strides, dtypes, devices and options match an earlier one's (the key
    the caller builds from exactly those) differs from it only in its data pointers and stream: those are
    written into the packed buffer (`words`, 64-bit words) and the rest is reused, instead of packing ~60
    fields per call."""

    __slots__ = ("buffer", "words", "args", "backward")

    def __init__(self, layout, fields):
        # A forward call's backward calls by (thread, dO's geometry): the rest of a backward's key follows
        # from the forward's (o, lse, dq, dk, dv are allocated from q, k, v), so the autograd path skips it.
        self.backward = {}
        self.buffer = ctypes.create_string_buffer(layout.size)
        layout.pack_into(self.buffer, 0, *fields)
        self.words = memoryview(self.buffer).cast("B").cast("Q")
        base = ctypes.addressof(self.buffer)
        tensors = layout.size // TENSOR_BYTES  # then the options
        self.args = tuple(base + i * TENSOR_BYTES for i in range(tensors + 1))


# In PackedCall.words: tensor i's data pointer is word i * TENSOR_WORDS; the stream is the options' word 6.
TENSOR_WORDS = TENSOR_BYTES // 8
FORWARD_STREAM_WORD = 5 * TENSOR_WORDS + 6
BACKWARD_STREAM_WORD = 9 * TENSOR_WORDS + 6
MAX_PACKED_CALLS = 256


class _PackedCalls(threading.local):
    """Each thread's packed calls by key (ctypes releases the GIL during a call, so threads must not share a
    buffer), a bounded number: a program with more distinct geometries than that repacks."""

    def __init__(self):
        self.forward = {}
        self.backward = {}


packed_calls = _PackedCalls()


class _CallBuffer(threading.local):
    """The per-thread buffer of the calls packed afresh every time (varlen: their offsets tensors make a cached
    geometry less useful; any call with ALiBi or sinks: the options point at tensors packed after the arguments)."""

    def __init__(self):
        self.buffer = ctypes.create_string_buffer(VARLEN_BACKWARD.size + EXTRAS.size)
        self.base = ctypes.addressof(self.buffer)
        self.kvcache = ctypes.create_string_buffer(KVCACHE.size)
        kv = ctypes.addressof(self.kvcache)
        self.kvcache_tensors = tuple(kv + i * TENSOR_BYTES for i in range(7))
        self.kvcache_index = kv + 7 * TENSOR_BYTES
        self.kvcache_options = self.kvcache_index + KVCACHE_INDEX_BYTES


_calls = _CallBuffer()


def describe_any(t):
    """The flashlm_tensor fields of a tensor of up to 6 dimensions (TENSOR_ANY), or NO_TENSOR for None."""
    if t is None:
        return NO_TENSOR
    pad = (0,) * (MAX_DIMS - t.dim())
    return (t.data_ptr(), t.dim(), _TORCH_DTYPES[t.dtype], t.is_cuda, *t.shape, *pad, *t.stride(), *pad)


_TORCH_DTYPES = {}  # torch dtype -> flashlm_dtype, filled by torch_ops (this module does not import torch)


def call_with_extras(c_function, layout, arg_offsets, fields, extras):
    """c_function on `layout`'s fields, whose options end before their six tensor pointers: those point at the
    `extras` (alibi_slopes, learnable_sink, dlearnable_sink, q_descale_heads, k_descale_heads, v_descale_heads;
    tensors or None, missing ones None), described after the arguments."""
    extras = tuple(extras) + (None,) * (EXTRA_TENSORS - len(extras))
    call = _calls
    extra_base = call.base + layout.size
    pointers = tuple(0 if t is None else extra_base + i * TENSOR_BYTES for i, t in enumerate(extras))
    layout.pack_into(call.buffer, 0, *fields, *pointers)
    EXTRAS.pack_into(call.buffer, layout.size, *(f for t in extras for f in describe_any(t)))
    check(c_function(*(call.base + offset for offset in arg_offsets)))


def packed(calls, key, layout, fields):
    """A new PackedCall of `fields` kept under `key` in `calls` (one of packed_calls' dictionaries)."""
    if len(calls) >= MAX_PACKED_CALLS:
        calls.clear()
    call = calls[key] = PackedCall(layout, fields)
    return call


def varlen_forward(*fields, extras=(None, None, None)):
    """flashlm_attention_varlen_forward on VARLEN_FORWARD's fields (q, k, v, o, lse, seqs, options less the three
    tensor pointers) and the options' extras (call_with_extras)."""
    call_with_extras(lib.flashlm_attention_varlen_forward, VARLEN_FORWARD, VARLEN_FORWARD_ARGS, fields, extras)


def varlen_backward(*fields, extras=(None, None, None)):
    """flashlm_attention_varlen_backward on VARLEN_BACKWARD's fields (q, k, v, o, lse, dout, dq, dk, dv, seqs,
    options less the three tensor pointers) and the options' extras."""
    call_with_extras(lib.flashlm_attention_varlen_backward, VARLEN_BACKWARD, VARLEN_BACKWARD_ARGS, fields, extras)


def with_kvcache(has_new, has_lse, *fields):
    """flashlm_attention_with_kvcache on KVCACHE's fields (q, k_cache, v_cache, k_new, v_new, o, lse, index,
    options); k_new / v_new (has_new false) and lse (has_lse false) go as NULL."""
    call = _calls
    KVCACHE.pack_into(call.kvcache, 0, *fields)
    q, kc, vc, kn, vn, o, lse = call.kvcache_tensors
    check(lib.flashlm_attention_with_kvcache(q, kc, vc, call.kvcache_index, kn if has_new else None,
                                             vn if has_new else None, o, lse if has_lse else None,
                                             call.kvcache_options))


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
