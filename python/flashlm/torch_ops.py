"""PyTorch front end: flashlm's attention as torch.library custom operators (torch >= 2.4), or as a plain
autograd.Function on older torch, through the C ABI (no compiled extension).

    torch.ops.flashlm.attention_fwd(q, k, v, layout, causal, bottom_right, scale, deterministic, impl,
                                    window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                    learnable_sink=None) -> (o, lse)
    torch.ops.flashlm.attention_bwd(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic,
                                    impl, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                    learnable_sink=None) -> (dq, dk, dv, dsink)

(dsink: the sink's gradient, float32 [heads_q], or an empty tensor without a learnable_sink.)

layout is "bshd" ([batch, seq, heads, head_dim]) or "bhsd" ([batch, heads, seq, head_dim]); any strides
with a unit last stride. o is allocated like q with v's head dim (same strides when q is dense and the head
dims agree), lse is [batch, heads_q,
seq_q] float32 (float64 for float64 CPU inputs), dq, dk, dv like q, k, v. The C side checks every
argument; Python only describes the tensors to it (packed once per call geometry, _lib.PackedCall).

Plain eager calls skip the operators' dispatcher round trip (_Attention below); under torch.compile,
export, fake tensors and torch.func the operators are what gets traced.
"""
import operator
import struct
import threading
from typing import Optional, Tuple

import torch

from . import _lib as L

_DTYPES = {torch.float64: L.FP64, torch.float32: L.FP32, torch.float16: L.FP16, torch.bfloat16: L.BF16}
# e4m3 inputs of the FP8 forward (bf16 output, no autograd; sm_90 GPUs and the CPU): torch >= 2.1 has the dtype.
_FP8 = getattr(torch, "float8_e4m3fn", None)
if _FP8 is not None:
    _DTYPES[_FP8] = L.FP8_E4M3
L._TORCH_DTYPES.update(_DTYPES)
_NO_DESCALE = (1.0, 1.0, 1.0)
# flashlm_attention_options' fields after the stream are the variant: window_size_left, window_size_right, softcap
# (flash-attn's window_size and softcap; checked by the library).
_NO_VARIANT = (-1, -1, 0.0)
# ... then the pointers to alibi_slopes, learnable_sink, dlearnable_sink and the per-head descales (0: none;
# _lib.call_with_extras sets them).
_NO_EXTRA_POINTERS = (0,) * L.EXTRA_TENSORS
_ALIGN = {"top_left": False, "top-left": False, "bottom_right": True, "bottom-right": True}
_IMPL = {"flash": L.FLASH, "naive": L.NAIVE}
# _forward and _backward write the data pointers and the stream at these words of a PackedCall.
assert L.TENSOR_WORDS == 15 and L.FORWARD_STREAM_WORD == 81 and L.BACKWARD_STREAM_WORD == 141
DOUBLE_BACKWARD_ERROR = ("flashlm attention: double backward (differentiating the attention's gradients, "
                         "create_graph=True) is not supported")

# The current stream as an integer without building a torch.cuda.Stream object (a few µs per call).
if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream
else:
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


_thread_id = threading.get_ident


def _describe(t, bhsd):
    """The packed flashlm_tensor fields of a 4-D t (data, ndim, dtype, device, sizes, strides), a [batch,
    heads, seq, head_dim] tensor described as its [batch, seq, heads, head_dim] view when bhsd. (is_cuda
    is the device code: CPU = 0, CUDA = 1.)"""
    s, st = t.shape, t.stride()
    if bhsd:
        return (t.data_ptr(), 4, _DTYPES[t.dtype], t.is_cuda, s[0], s[2], s[1], s[3], st[0], st[2], st[1], st[3])
    return (t.data_ptr(), 4, _DTYPES[t.dtype], t.is_cuda, *s, *st)


def _describe_lse(t):
    return (t.data_ptr(), 3, _DTYPES[t.dtype], t.is_cuda, *t.shape, *t.stride())


def _options(causal, bottom_right, scale, deterministic, impl, descales=_NO_DESCALE):
    """The packed flashlm_attention_options fields, less the stream."""
    return (_IMPL[impl], causal, bottom_right, deterministic, scale is not None, 0.0 if scale is None else scale,
            *descales)


def _why_not_packable(named_tensors, impl, ndim=4, scale=None):
    """The error for arguments _describe/_options could not pack (the C side checks everything else); ndim is
    the tensors' (lse has one fewer)."""
    for t, name in named_tensors:
        if not isinstance(t, torch.Tensor):
            return L.FlashlmValueError(f"{name}: expected a tensor, got {type(t).__name__}")
        want = ndim - 1 if name == "lse" else ndim
        if t.dim() != want:
            return L.FlashlmValueError(f"{name}: expected {want} dimensions, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            return L.FlashlmValueError(f"{name}: dtype {t.dtype} is not supported (float64, float32, float16, "
                                       "bfloat16, float8_e4m3fn)")
    if impl not in _IMPL:
        return L.FlashlmValueError(f"impl: '{impl}' is not flash or naive")
    if scale is not None and not isinstance(scale, (int, float)):
        return L.FlashlmValueError(f"scale: expected a number or None, got {type(scale).__name__}")
    return L.FlashlmValueError("attention: the arguments could not be described to the C library")


def _is_bhsd(layout):
    if layout == "bshd":
        return False
    if layout == "bhsd":
        return True
    raise L.FlashlmValueError(f"layout: '{layout}' is not bshd or bhsd")


def _stream(q):
    """q's current CUDA stream as an integer (0 on the CPU), or None when q is on another device than the
    current one: the C ABI works on the calling thread's current device, so the caller switches first."""
    if not q.is_cuda:
        return 0
    index = q.get_device()
    return _raw_stream(index) if torch.cuda.current_device() == index else None


def _call(c_function, q, fields, variant, extras=(None, None, None)):
    """Calls the C function on the packed fields with q's current CUDA stream and the options' fields after it
    appended, on q's device (the varlen calls; the others write the stream into their PackedCall); extras: the
    options' alibi_slopes, learnable_sink, dlearnable_sink (_lib.call_with_extras)."""
    stream = _stream(q)
    if stream is None:
        with torch.cuda.device(q.get_device()):
            return c_function(*fields, _raw_stream(q.get_device()), *variant, extras=extras)
    return c_function(*fields, stream, *variant, extras=extras)


def _lse_dtype(q):
    """float64 for float64 CPU inputs, else float32."""
    return torch.float64 if q.dtype is torch.float64 and not q.is_cuda else torch.float32


def _forward_outputs(q, layout, v=None):
    """o (like q with v's head dim: q's strides when q is dense and the head dims agree; bfloat16 for
    float8_e4m3fn q) and lse [batch, heads_q, seq_q], allocated as the operator's real and fake kernels both do."""
    bhsd = _is_bhsd(layout)
    if q.dim() != 4:
        raise L.FlashlmValueError(f"q: expected 4 dimensions ({layout}), got shape {tuple(q.shape)}")
    b, x, y, d = q.shape
    lse_dtype = _lse_dtype(q)
    # Sizes as separate arguments: torch.empty parses them faster than a tuple.
    lse = torch.empty(b, x, y, dtype=lse_dtype, device=q.device) if bhsd else \
        torch.empty(b, y, x, dtype=lse_dtype, device=q.device)
    if isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[3] != d:  # a head_dim_v of its own: a dense o
        return torch.empty(b, x, y, v.shape[3], dtype=q.dtype, device=q.device), lse
    return (torch.empty_like(q, dtype=torch.bfloat16) if q.dtype == _FP8 else torch.empty_like(q)), lse


def _forward(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left=-1, window_right=-1,
             softcap=0.0, alibi_slopes=None, learnable_sink=None, descales=_NO_DESCALE):
    """Runs the forward on tensors in `layout`: (o, lse)."""
    if alibi_slopes is not None or learnable_sink is not None:
        return _forward_extras(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                               window_right, softcap, alibi_slopes, learnable_sink)
    o, lse, _ = _forward_packed(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                                window_right, softcap,
                                descales)
    return o, lse


def _check_extras(alibi_slopes, learnable_sink):
    """The ALiBi slopes and sinks as the C side reads them (tensors; float32; their shapes are checked there)."""
    for t, name in ((alibi_slopes, "alibi_slopes"), (learnable_sink, "learnable_sink")):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise L.FlashlmValueError(f"{name}: expected a float32 tensor or None, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise L.FlashlmValueError(f"{name}: expected dtype torch.float32, got {t.dtype}")
        if t.dim() > L.MAX_DIMS:
            raise L.FlashlmValueError(f"{name}: expected [heads_q] or [batch, heads_q], got shape {tuple(t.shape)}")


def _forward_extras(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left, window_right,
                    softcap, alibi_slopes, learnable_sink):
    """The forward with ALiBi or sinks."""
    _check_extras(alibi_slopes, learnable_sink)
    return _forward_with_extras(q, k, v, layout, causal, bottom_right, scale, deterministic, impl,
                                (window_left, window_right, softcap), (alibi_slopes, learnable_sink))


def _forward_with_extras(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, variant, extras):
    """The forward with tensors in its options (`extras`, _lib.call_with_extras's order): (o, lse), packed afresh
    per call."""
    o, lse = _forward_outputs(q, layout, v)
    bhsd = _is_bhsd(layout)
    try:
        fields = (*_describe(q, bhsd), *_describe(k, bhsd), *_describe(v, bhsd), *_describe(o, bhsd),
                  *_describe_lse(lse), *_options(causal, bottom_right, scale, deterministic, impl))
        _call(_extras_forward, q, fields, variant, extras)
    except (KeyError, IndexError, TypeError, AttributeError, struct.error):
        raise _why_not_packable(((q, "q"), (k, "k"), (v, "v")), impl, scale=scale) from None
    return o, lse


def _extras_forward(*fields, extras):
    L.call_with_extras(L.lib.flashlm_attention_forward, L.FORWARD, L.FORWARD_ARGS, fields, extras)


def _extras_backward(*fields, extras):
    L.call_with_extras(L.lib.flashlm_attention_backward, L.BACKWARD, L.BACKWARD_ARGS, fields, extras)


def _forward_packed(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left=-1,
                    window_right=-1, softcap=0.0,
                    descales=_NO_DESCALE):
    """The forward: (o, lse, the call's PackedCall, which _backward can take to skip most of its key). Every
    eager call runs this, so it is kept to the two allocations, the attribute reads that make the key of the
    call's packed arguments (_lib.PackedCall: everything but the data pointers and stream, which are written
    per call) and the C call."""
    stream = _stream(q)
    if stream is None:
        with torch.cuda.device(q.get_device()):
            return _forward_packed(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                                   window_right, softcap,
                                   descales)
    o, lse = _forward_outputs(q, layout, v)
    try:
        # o and lse are functions of q's and v's key entries (like q with v's head dim; a fresh [batch, heads, seq]).
        key = (layout, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.is_cuda, k.is_cuda, v.is_cuda, causal, bottom_right, scale, deterministic, impl, descales,
               window_left, window_right, softcap)
        calls = L.packed_calls.forward
        call = calls.get(key)
        if call is None:
            bhsd = layout == "bhsd"
            call = L.packed(calls, key, L.FORWARD, (
                *_describe(q, bhsd), *_describe(k, bhsd), *_describe(v, bhsd), *_describe(o, bhsd),
                *_describe_lse(lse), *_options(causal, bottom_right, scale, deterministic, impl, descales), 0,
                window_left, window_right, softcap, *_NO_EXTRA_POINTERS))
    except (KeyError, IndexError, TypeError, AttributeError, struct.error):
        raise _why_not_packable(((q, "q"), (k, "k"), (v, "v")), impl, scale=scale) from None
    w = call.words  # the data pointers of q, k, v, o, lse and the stream (L.TENSOR_WORDS = 15 words a tensor)
    w[0], w[15], w[30], w[45], w[60], w[81] = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), stream
    status = L.lib.flashlm_attention_forward(*call.args)
    if status:
        L.check(status)
    return o, lse, call


def _backward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl, window_left=-1,
              window_right=-1, softcap=0.0,
              forward_call=None, descales=_NO_DESCALE, grad_dtype=None):
    """Runs the backward on tensors in `layout`: (dq, dk, dv), allocated like q, k, v (packed as _forward), in
    grad_dtype where given (the FP8 backward's bfloat16 or float32: the gradients of the dequantised values).
    forward_call: the PackedCall of the _forward_packed call that made o and lse from these q, k, v with
    these options, if the caller has it (the autograd path); then dO's geometry is the rest of the key.
    (_backward_extras takes ALiBi and sinks.)"""
    stream = _stream(q)
    if stream is None:
        with torch.cuda.device(q.get_device()):
            return _backward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                             window_left, window_right, softcap, forward_call, descales, grad_dtype)
    if dout.stride(-1) != 1 or dout.numel() == 0:
        # .sum().backward() hands an expanded (stride 0) gradient; an empty one keeps its zero strides
        # through .contiguous(), so it gets fresh ones.
        dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device).copy_(dout)
    dq, dk, dv = (torch.empty_like(q, dtype=grad_dtype), torch.empty_like(k, dtype=grad_dtype),
                  torch.empty_like(v, dtype=grad_dtype))
    call = None
    if forward_call is not None:
        short_key = (_thread_id(), dout.shape, dout.stride(), dout.dtype, dout.is_cuda)
        call = forward_call.backward.get(short_key)
    if call is None:
        call = _packed_backward(dout, q, k, v, o, lse, dq, dk, dv, layout, causal, bottom_right, scale,
                                deterministic, impl, window_left, window_right, softcap, descales)
        if forward_call is not None:
            if len(forward_call.backward) >= 16:
                forward_call.backward.clear()
            forward_call.backward[short_key] = call
    w = call.words  # q, k, v, o, lse, dout, dq, dk, dv, the stream
    w[0], w[15], w[30], w[45], w[60], w[75], w[90], w[105], w[120], w[141] = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), dout.data_ptr(), dq.data_ptr(),
        dk.data_ptr(), dv.data_ptr(), stream)
    status = L.lib.flashlm_attention_backward(*call.args)
    if status:
        L.check(status)
    return dq, dk, dv


def _packed_backward(dout, q, k, v, o, lse, dq, dk, dv, layout, causal, bottom_right, scale, deterministic, impl,
                     window_left, window_right, softcap, descales=_NO_DESCALE):
    """The backward's PackedCall for these tensors' geometry and these options (from the per-thread cache)."""
    try:
        # dq, dk, dv are functions of q's, k's and v's key entries (empty_like) and of their dtype.
        key = (layout, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(), lse.shape,
               lse.stride(), dout.shape, dout.stride(), q.dtype, k.dtype, v.dtype, o.dtype, lse.dtype, dout.dtype,
               dq.dtype, q.is_cuda, k.is_cuda, v.is_cuda, o.is_cuda, lse.is_cuda, dout.is_cuda, causal, bottom_right,
               scale, deterministic, impl, window_left, window_right, softcap, descales)
        calls = L.packed_calls.backward
        call = calls.get(key)
        if call is None:
            bhsd = _is_bhsd(layout)
            call = L.packed(calls, key, L.BACKWARD, (
                *_describe(q, bhsd), *_describe(k, bhsd), *_describe(v, bhsd), *_describe(o, bhsd),
                *_describe_lse(lse), *_describe(dout, bhsd), *_describe(dq, bhsd), *_describe(dk, bhsd),
                *_describe(dv, bhsd), *_options(causal, bottom_right, scale, deterministic, impl, descales), 0,
                window_left, window_right, softcap, *_NO_EXTRA_POINTERS))
    except (KeyError, IndexError, TypeError, AttributeError, struct.error):
        raise _why_not_packable(((q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"), (dout, "dout")), impl,
                                scale=scale) from None
    return call


def _fp8_heads_forward(q, k, v, layout, causal, bottom_right, scale, q_descale, k_descale, v_descale):
    """The FP8 forward with per-head descales (float32 [batch, heads_k] tensors, the options' q/k/v_descale_heads;
    the C library checks them): (o bfloat16, lse float32)."""
    return _forward_with_extras(q, k, v, layout, causal, bottom_right, scale, False, "flash", _NO_VARIANT,
                                (None, None, None, q_descale, k_descale, v_descale))


def _fp8_heads_backward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, q_descale, k_descale,
                        v_descale, deterministic, grad_dtype):
    """The FP8 backward with per-head descales: (dq, dk, dv) in grad_dtype, the gradients of the dequantised
    values."""
    return _backward_with_extras(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, "flash",
                                 _NO_VARIANT, (None, None, None, q_descale, k_descale, v_descale), grad_dtype)


def _per_head(descale, q, layout, heads_k):
    """A per-head descale as the [batch, 1, heads_q, 1] (bshd) or [batch, heads_q, 1, 1] (bhsd) factor of a
    gradient laid out like q (heads_k: the tensor's own head count, q's or k's)."""
    heads = q.shape[1] if _is_bhsd(layout) else q.shape[2]
    d = descale.repeat_interleave(heads // heads_k, dim=1)
    return d[:, :, None, None] if _is_bhsd(layout) else d[:, None, :, None]


def _backward_extras(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                     window_right, softcap, alibi_slopes, learnable_sink):
    """The backward with ALiBi or sinks: (dq, dk, dv, dsink), dsink the sink's gradient (float32 [heads_q]) or an
    empty tensor without a sink; packed afresh per call."""
    _check_extras(alibi_slopes, learnable_sink)
    dsink = _sink_grad_like(learnable_sink, q)
    dq, dk, dv = _backward_with_extras(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                                       (window_left, window_right, softcap),
                                       (alibi_slopes, learnable_sink, dsink if learnable_sink is not None else None))
    return dq, dk, dv, dsink


def _backward_with_extras(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl, variant,
                          extras, grad_dtype=None):
    """The backward with tensors in its options (`extras`, _lib.call_with_extras's order): (dq, dk, dv), allocated
    like q, k, v (in grad_dtype where given), packed afresh per call."""
    if dout.stride(-1) != 1 or dout.numel() == 0:
        dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device).copy_(dout)
    dq, dk, dv = (torch.empty_like(q, dtype=grad_dtype), torch.empty_like(k, dtype=grad_dtype),
                  torch.empty_like(v, dtype=grad_dtype))
    named = ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"), (dout, "dout"))
    bhsd = _is_bhsd(layout)
    try:
        fields = (*_describe(q, bhsd), *_describe(k, bhsd), *_describe(v, bhsd), *_describe(o, bhsd),
                  *_describe_lse(lse), *_describe(dout, bhsd), *_describe(dq, bhsd), *_describe(dk, bhsd),
                  *_describe(dv, bhsd), *_options(causal, bottom_right, scale, deterministic, impl))
        _call(_extras_backward, q, fields, variant, extras)
    except (KeyError, IndexError, TypeError, AttributeError, struct.error):
        raise _why_not_packable(named, impl, scale=scale) from None
    return dq, dk, dv


def _sink_grad_like(learnable_sink, q):
    """The sink's gradient buffer: float32 like the sink, or an empty float32 tensor on q's device without one."""
    if learnable_sink is None:
        return torch.empty(0, dtype=torch.float32, device=q.device)
    return torch.empty(learnable_sink.shape, dtype=torch.float32, device=learnable_sink.device)


def _backward_any(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl, window_left=-1,
                  window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None, forward_call=None):
    """(dq, dk, dv, dsink) with or without ALiBi and sinks (dsink empty without a sink)."""
    if alibi_slopes is not None or learnable_sink is not None:
        return _backward_extras(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                                window_left, window_right, softcap, alibi_slopes, learnable_sink)
    dq, dk, dv = _backward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                           window_left, window_right, softcap, forward_call)
    return dq, dk, dv, _sink_grad_like(None, q)


# Autocast. SDPA is on autocast's lower-precision list: inside torch.autocast its floating inputs (float64
# aside) are cast to the region's dtype, so a model whose RoPE'd q, k come out float32 beside a bfloat16 v
# works. flashlm's attention does the same: the front ends below cast in eager code (which calls the C
# library without the dispatcher), and the operators carry the rule as an Autocast kernel for compiled code
# and direct torch.ops callers. torch.library.register_autocast casts to one dtype fixed when registered;
# SDPA follows the region's (bfloat16 or float16), hence the kernel registered by hand below.
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_dtype(device_type):
    """The dtype autocast casts SDPA's inputs to on device_type ("cpu" or "cuda"), or None outside it."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


def _autocast_args(args, device_type):
    """args with q, k, v (the first three) cast to autocast's dtype where they are floating and not float64
    (SDPA's lower_precision_fp policy for its inputs); args itself outside autocast. The rest is left as it
    is: ALiBi slopes and sinks are float32 by contract (as in flash-attn) and a cast would have them refused."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return args
    dtype = _autocast_dtype(device_type)
    if dtype is None:
        return args
    qkv = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.dtype != dtype and a.is_floating_point()
                and a.dtype != torch.float64 else a for a in args[:3])
    return qkv + tuple(args[3:])


def _autocast_qkv(q, k, v):
    if not isinstance(q, torch.Tensor):
        return q, k, v  # not tensors: the caller's checks say so
    return _autocast_args((q, k, v), q.device.type)


def _register_autocast(op, name):
    """The lower-precision rule as op's AutocastCPU and AutocastCUDA kernels (as register_autocast registers
    its fixed-dtype one: a C++ kernel and, for tracing under the Python dispatcher, a py_impl)."""
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        dispatch_key = getattr(torch._C.DispatchKey, key)

        def kernel(*args, _device_type=device_type, _dispatch_key=dispatch_key):
            args = _autocast_args(args, _device_type)  # before the guard, which hides autocast's state
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_dispatch_key)):
                return op(*args)

        op.py_impl(dispatch_key)(kernel)
        _AUTOCAST_LIBRARY.impl(name, kernel, key)


HAS_CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")
_DIRECT_LIBRARY = None


def _register_direct_kernels(kernels):
    """The operators' CPU and CUDA kernels registered as the plain Python functions they wrap. custom_op's own
    kernel reaches them through several Python layers (its backend wrapper, a dynamo-disable wrapper, an aliasing
    check): about 10 µs a call, which a compiled model pays at every attention call of every step, where the
    host is often what bounds a short step. The functions return fresh tensors (the aliasing check's point), and
    the fake kernels, autograd formulas and autocast rules stay the custom ops'."""
    global _DIRECT_LIBRARY
    if _DIRECT_LIBRARY is None:
        _DIRECT_LIBRARY = torch.library.Library("flashlm", "IMPL")
    for name, fn in kernels.items():
        for key in ("CPU", "CUDA"):
            _DIRECT_LIBRARY.impl(name, fn, key)

if HAS_CUSTOM_OPS:
    @torch.library.custom_op("flashlm::attention_fwd", mutates_args=())
    def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, causal: bool,
                      bottom_right: bool, scale: Optional[float], deterministic: bool, impl: str,
                      window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                      alibi_slopes: Optional[torch.Tensor] = None,
                      learnable_sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention forward: (o, lse). `deterministic` is the backward's (an input so that the autograd
        formula sees it); window_left/right, softcap, alibi_slopes and learnable_sink are flash-attn's."""
        return _forward(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left, window_right,
                        softcap, alibi_slopes, learnable_sink)

    @attention_fwd.register_fake
    def _attention_fwd_fake(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left=-1,
                            window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None):
        return _forward_outputs(q, layout, v)

    @torch.library.custom_op("flashlm::attention_bwd", mutates_args=())
    def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, layout: str, causal: bool, bottom_right: bool, scale: Optional[float],
                      deterministic: bool, impl: str, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                      learnable_sink: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention backward on the forward's tensors and dO: (dq, dk, dv, dsink), dq, dk, dv allocated like q,
        k, v; dsink the sink's gradient (float32 [heads_q]; empty without a learnable_sink)."""
        return _backward_any(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                             window_left, window_right, softcap, alibi_slopes, learnable_sink)

    @attention_bwd.register_fake
    def _attention_bwd_fake(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                            window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _sink_grad_like(learnable_sink, q)

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v = inputs[:3]
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, *inputs[12:14])  # alibi_slopes, learnable_sink (or None)
        ctx.args = inputs[3:12]  # layout, causal, bottom_right, scale, deterministic, impl, window_left/right, softcap
        ctx.mark_non_differentiable(lse)

    def _fwd_backward(ctx, dout, dlse):
        q, k, v, o, lse, alibi_slopes, learnable_sink = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True, or under a torch.func transform
            dq, dk, dv, dsink = _AttentionBackwardOps.apply(dout, q, k, v, o, lse, *ctx.args, alibi_slopes,
                                                            learnable_sink)
        else:
            dq, dk, dv, dsink = _BWD_OP(dout, q, k, v, o, lse, *ctx.args, alibi_slopes, learnable_sink)
        return (dq, dk, dv, *([None] * 10), dsink if learnable_sink is not None else None)

    def _refuse_double_backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)

    @torch.library.custom_op("flashlm::attention_fp8_fwd", mutates_args=())
    def attention_fp8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, causal: bool,
                          bottom_right: bool, scale: Optional[float], q_descale: float, k_descale: float,
                          v_descale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """The FP8 forward: float8_e4m3fn q, k, v with per-tensor descale factors, (o bfloat16, lse float32).
        Differentiable through attention_fp8_bwd (_fp8_fwd_backward says what autograd makes of it)."""
        return _forward(q, k, v, layout, causal, bottom_right, scale, False, "flash",
                        descales=(q_descale, k_descale, v_descale))

    @attention_fp8_fwd.register_fake
    def _attention_fp8_fwd_fake(q, k, v, layout, causal, bottom_right, scale, q_descale, k_descale, v_descale):
        return _forward_outputs(q, layout)

    @torch.library.custom_op("flashlm::attention_fp8_bwd", mutates_args=())
    def attention_fp8_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor, layout: str, causal: bool, bottom_right: bool, scale: Optional[float],
                          q_descale: float, k_descale: float, v_descale: float, deterministic: bool,
                          grad_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The FP8 backward on attention_fp8_fwd's tensors and dO (bfloat16): (dq, dk, dv) in grad_dtype
        (torch.bfloat16 or torch.float32), the gradients of the dequantised values (stored * descale), as the
        C++ API gives them: what a training step that quantised its bf16 q, k, v applies to them."""
        return _backward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, "flash",
                         descales=(q_descale, k_descale, v_descale), grad_dtype=grad_dtype)

    @attention_fp8_bwd.register_fake
    def _attention_fp8_bwd_fake(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, q_descale, k_descale,
                                v_descale, deterministic, grad_dtype):
        return (torch.empty_like(q, dtype=grad_dtype), torch.empty_like(k, dtype=grad_dtype),
                torch.empty_like(v, dtype=grad_dtype))

    def _fp8_fwd_setup_context(ctx, inputs, output):
        q, k, v = inputs[:3]
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = inputs[3:]  # layout, causal, bottom_right, scale, q_descale, k_descale, v_descale
        ctx.mark_non_differentiable(lse)

    def _fp8_fwd_backward(ctx, dout, dlse):
        """Autograd's gradients are those of the op's inputs, the stored e4m3 values: value = stored * descale,
        so d/d(stored) = descale * d/d(value), computed in float32 from attention_fp8_bwd's. Autograd then casts
        each to its input's dtype, float8_e4m3fn (3 mantissa bits, NaN past 448): where the gradients of the
        dequantised values are wanted at full precision, call attention_fp8_bwd (or the C++ API)."""
        q, k, v, o, lse = ctx.saved_tensors
        layout, causal, bottom_right, scale, *descales = ctx.args
        grads = _FP8_BWD_OP(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, *descales, False,
                            torch.float32)
        return (*(g * d for g, d in zip(grads, descales)), *([None] * 7))

    attention_fp8_fwd.register_autograd(_fp8_fwd_backward, setup_context=_fp8_fwd_setup_context)
    attention_fp8_bwd.register_autograd(_refuse_double_backward)
    _FP8_BWD_OP = torch.ops.flashlm.attention_fp8_bwd.default

    @torch.library.custom_op("flashlm::attention_fp8_heads_fwd", mutates_args=())
    def attention_fp8_heads_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, causal: bool,
                                bottom_right: bool, scale: Optional[float], q_descale: torch.Tensor,
                                k_descale: torch.Tensor, v_descale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """attention_fp8_fwd with per-head descales: float32 [batch, heads_k] each (FlashAttention-3's), q's
        applying to every query head of the key head's group. The CPU and CUDA (sm_90, head dims 64/128) run it."""
        return _fp8_heads_forward(q, k, v, layout, causal, bottom_right, scale, q_descale, k_descale, v_descale)

    @attention_fp8_heads_fwd.register_fake
    def _attention_fp8_heads_fwd_fake(q, k, v, layout, causal, bottom_right, scale, q_descale, k_descale, v_descale):
        return _forward_outputs(q, layout)

    @torch.library.custom_op("flashlm::attention_fp8_heads_bwd", mutates_args=())
    def attention_fp8_heads_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                o: torch.Tensor, lse: torch.Tensor, layout: str, causal: bool, bottom_right: bool,
                                scale: Optional[float], q_descale: torch.Tensor, k_descale: torch.Tensor,
                                v_descale: torch.Tensor, deterministic: bool,
                                grad_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """attention_fp8_bwd with per-head descales: the gradients of the dequantised values in grad_dtype."""
        return _fp8_heads_backward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, q_descale, k_descale,
                                   v_descale, deterministic, grad_dtype)

    @attention_fp8_heads_bwd.register_fake
    def _attention_fp8_heads_bwd_fake(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, q_descale,
                                      k_descale, v_descale, deterministic, grad_dtype):
        return (torch.empty_like(q, dtype=grad_dtype), torch.empty_like(k, dtype=grad_dtype),
                torch.empty_like(v, dtype=grad_dtype))

    def _fp8_heads_fwd_setup_context(ctx, inputs, output):
        q, k, v, layout, causal, bottom_right, scale, qd, kd, vd = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, qd, kd, vd)
        ctx.args = (layout, causal, bottom_right, scale)
        ctx.mark_non_differentiable(lse)

    def _fp8_heads_fwd_backward(ctx, dout, dlse):
        """As _fp8_fwd_backward, each head's gradient times its own descale (the descales get none)."""
        q, k, v, o, lse, qd, kd, vd = ctx.saved_tensors
        layout, causal, bottom_right, scale = ctx.args
        dq, dk, dv = _FP8_HEADS_BWD_OP(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, qd, kd, vd, False,
                                       torch.float32)
        hk = kd.shape[1]
        return (dq * _per_head(qd, q, layout, hk), dk * _per_head(kd, k, layout, hk),
                dv * _per_head(vd, v, layout, hk), *([None] * 7))

    attention_fp8_heads_fwd.register_autograd(_fp8_heads_fwd_backward, setup_context=_fp8_heads_fwd_setup_context)
    attention_fp8_heads_bwd.register_autograd(_refuse_double_backward)
    _FP8_HEADS_BWD_OP = torch.ops.flashlm.attention_fp8_heads_bwd.default

    attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
    attention_bwd.register_autograd(_refuse_double_backward)
    _FWD_OP = torch.ops.flashlm.attention_fwd.default
    _AUTOCAST_LIBRARY = torch.library.Library("flashlm", "FRAGMENT")
    _register_autocast(_FWD_OP, "attention_fwd")
    _BWD_OP = torch.ops.flashlm.attention_bwd.default
    _register_direct_kernels({"attention_fwd": _forward, "attention_bwd": _backward_any})

    class _AttentionOps(torch.autograd.Function):
        """The operators' autograd formula as an autograd.Function with setup_context, which torch.func
        transforms (grad, vjp) accept; the op's own registered autograd (the same formula, for callers of
        torch.ops.flashlm directly) is not usable under them in torch <= 2.15."""

        @staticmethod
        def forward(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left, window_right,
                    softcap, alibi_slopes, learnable_sink):
            return _FWD_OP(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                           window_right, softcap, alibi_slopes, learnable_sink)

        setup_context = staticmethod(_fwd_setup_context)
        backward = staticmethod(_fwd_backward)

    class _AttentionBackwardOps(torch.autograd.Function):
        """The backward operator where its result could be differentiated again: that raises the clear
        error (the op's registered refusal is not reachable under torch.func transforms)."""

        @staticmethod
        def forward(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                    window_right, softcap, alibi_slopes, learnable_sink):
            return _BWD_OP(dout, q, k, v, o, lse, layout, causal, bottom_right, scale, deterministic, impl,
                           window_left, window_right, softcap, alibi_slopes, learnable_sink)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        backward = staticmethod(_refuse_double_backward)


class _NoDoubleBackward(torch.autograd.Function):
    """Copies the gradients, as functions of the attention's inputs whose own backward (a double backward)
    raises a clear error instead of torch's "does not require grad"."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *inputs):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _once_differentiable(grads, inputs):
    """The gradients; under create_graph=True (grad mode on inside backward) tied to `inputs` through a
    node that refuses to be differentiated."""
    if not torch.is_grad_enabled():
        return grads
    return _NoDoubleBackward.apply(*grads, *inputs)


class _Attention(torch.autograd.Function):
    """The eager autograd path: the C calls straight from an autograd.Function, without the dispatcher's
    trip through the custom operators (tens of µs per call in eager mode). The only path on torch
    without torch.library.custom_op (Debian's 1.13, say)."""

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left, window_right,
                softcap, alibi_slopes=None, learnable_sink=None):
        if alibi_slopes is None and learnable_sink is None:
            o, lse, call = _forward_packed(q, k, v, layout, causal, bottom_right, scale, deterministic, impl,
                                           window_left, window_right, softcap)
        else:
            o, lse = _forward_extras(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, window_left,
                                     window_right, softcap, alibi_slopes, learnable_sink)
            call = None
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, learnable_sink)
        ctx.args = (layout, causal, bottom_right, scale, deterministic, impl, window_left, window_right, softcap)
        ctx.call = call
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse, alibi_slopes, learnable_sink = ctx.saved_tensors
        *grads, dsink = _backward_any(dout, q, k, v, o, lse, *ctx.args, alibi_slopes, learnable_sink, ctx.call)
        grads = _once_differentiable(tuple(grads), (q, k, v, dout))
        return (*grads, *([None] * 10), dsink if learnable_sink is not None else None)


def _traced(q):
    """Whether the call is being traced or transformed (torch.compile, export, FakeTensorMode, torch.func,
    a tensor subclass), where the custom operators must be called; plain eager calls take _Attention."""
    return HAS_CUSTOM_OPS and (type(q) is not torch.Tensor or torch.compiler.is_compiling()
                               or torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack() > 0)


def _attention(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, variant=_NO_VARIANT,
               alibi_slopes=None, learnable_sink=None):
    q, k, v = _autocast_qkv(q, k, v)
    if _traced(q):
        return _AttentionOps.apply(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, *variant,
                                   alibi_slopes, learnable_sink)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        return _Attention.apply(q, k, v, layout, causal, bottom_right, scale, deterministic, impl, *variant,
                                alibi_slopes, learnable_sink)
    return _forward(q, k, v, layout, causal, bottom_right, scale, deterministic, impl,
                    *variant, alibi_slopes, learnable_sink)[0]  # no graph to record


def _require_tensor(t, name):
    """numpy arrays and lists have no .dim(): a TypeError saying what is needed, not an AttributeError from
    inside."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__qualname__} "
                        "(flashlm attention takes tensors: convert with torch.as_tensor)")


def _check_4d(tensors, layout):
    """Raises for the first of (tensor, name) that is not a 4-D tensor. (Callers test q.dim() etc. first: this
    runs on every call.)"""
    for t, name in tensors:
        _require_tensor(t, name)
        if t.dim() != 4:
            raise L.FlashlmValueError(f"{name}: expected 4 dimensions ({layout}), got shape {tuple(t.shape)}")


def _bottom_right(causal, causal_align, seq_q, seq_k):
    """Whether the causal mask is bottom-right aligned; when seq_q != seq_k the caller must have said which."""
    if causal_align is None:
        if causal and seq_q != seq_k:
            raise L.FlashlmValueError(
                f"causal_align: seq_q = {seq_q} differs from seq_k = {seq_k}, so the causal mask needs an "
                "alignment: 'top_left' (query i sees keys j <= i, PyTorch's is_causal) or 'bottom_right' "
                "(j <= i + seq_k - seq_q, flash-attn's)")
        return False
    try:
        return _ALIGN[causal_align]
    except KeyError:
        raise L.FlashlmValueError(f"causal_align: '{causal_align}' is not top_left or bottom_right") from None


def _seq_dim(layout):
    return 2 if _is_bhsd(layout) else 1


def _fp8_attention(q, k, v, layout, causal, bottom_right, scale, descales):
    """The FP8 forward's o: the custom operator where the call is traced or records a graph (its autograd
    formula: attention_fp8_bwd), the C call otherwise. A descale given as a tensor makes all three per-head
    (attention_fp8_heads_fwd; a float or None beside it becomes a tensor of that value)."""
    differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if any(isinstance(x, torch.Tensor) for x in descales):
        if not HAS_CUSTOM_OPS:
            raise L.FlashlmValueError(f"q_descale, k_descale, v_descale: per-head descales need torch.library."
                                      f"custom_op (torch >= 2.4); this is torch {torch.__version__}")
        heads_k = k.shape[1] if _is_bhsd(layout) else k.shape[2]
        d = tuple(x if isinstance(x, torch.Tensor) else
                  torch.full((q.shape[0], heads_k), 1.0 if x is None else float(x), dtype=torch.float32,
                             device=q.device) for x in descales)
        return torch.ops.flashlm.attention_fp8_heads_fwd(q, k, v, layout, causal, bottom_right, scale, *d)[0]
    d = tuple(1.0 if x is None else float(x) for x in descales)
    if _traced(q) or (differentiable and HAS_CUSTOM_OPS):
        return torch.ops.flashlm.attention_fp8_fwd(q, k, v, layout, causal, bottom_right, scale, *d)[0]
    if differentiable:
        raise L.FlashlmValueError("q, k, v: float8_e4m3fn inputs that require grad need torch.library.custom_op "
                                  f"(torch >= 2.4) for the FP8 backward; this is torch {torch.__version__}")
    return _forward(q, k, v, layout, causal, bottom_right, scale, False, "flash", descales=d)[0]


def attention(q, k, v, *, layout, causal=False, scale=None, causal_align=None, deterministic=False, impl="flash",
              q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              learnable_sink=None):
    """Scaled dot-product attention with flashlm's kernels, differentiable (first order).

    layout (required): "bshd" for q [batch, seq_q, heads_q, head_dim] and k, v [batch, seq_k, heads_k,
    head_dim], or "bhsd" for [batch, heads, seq, head_dim] (F.scaled_dot_product_attention's). heads_q a
    multiple of heads_k (GQA). Any strides with a unit last stride; CPU or CUDA tensors (the current CUDA
    stream is used); float32/float16/bfloat16 (float64 on the CPU). causal_align "top_left" is PyTorch's
    is_causal, "bottom_right" flash-attn's; it must be given for a causal mask with seq_q != seq_k.
    flash_attn_func and scaled_dot_product_attention take those libraries' signatures.

    torch.float8_e4m3fn q, k, v run the FP8 forward (CUDA on an sm_90 GPU at head dims 64 and 128, the CPU at
    any): q_descale, k_descale, v_descale (floats, default 1) are the per-tensor factors the fp8 values were
    divided by; S = scale * q_descale * k_descale * q k^T, the output (bfloat16) is v_descale * softmax(S) v.
    Per-head descales (FlashAttention-3's): float32 [batch, heads_k] tensors, q's applying to every query head of
    the key head's group (torch.ops.flashlm.attention_fp8_heads_fwd/_bwd; CPU and CUDA).
    Differentiable (CUDA and CPU, torch >= 2.4): autograd's gradients of the e4m3 inputs are descale times those
    of the dequantised values, cast by autograd to float8_e4m3fn; torch.ops.flashlm.attention_fp8_bwd gives the
    gradients of the dequantised values in bfloat16 or float32.

    window_size = (left, right) and softcap: flash-attn's sliding window (aligned as the causal mask,
    causal_align; top-left without one) and soft-capping; alibi_slopes (aligned the same way) and learnable_sink
    as flash_attn_func's; v may have a head dim of its own; on the CPU for now.
    """
    seq = _seq_dim(layout)
    try:
        four_d = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    except AttributeError:  # not tensors: _check_4d says so
        four_d = False
    if not four_d:
        _check_4d(((q, "q"), (k, "k"), (v, "v")), layout)
    bottom_right = _bottom_right(causal, causal_align, q.shape[seq], k.shape[seq])
    descales = (q_descale, k_descale, v_descale)
    if _FP8 is not None and q.dtype == _FP8:
        return _fp8_attention(q, k, v, layout, bool(causal), bottom_right, scale, descales)
    if any(x is not None for x in descales):
        raise L.FlashlmValueError(f"q_descale, k_descale, v_descale: apply to torch.float8_e4m3fn inputs only (q is "
                                  f"{q.dtype})")
    variant = _NO_VARIANT if window_size == (-1, -1) and softcap == 0.0 else _variant(window_size, softcap)
    return _attention(q, k, v, layout, bool(causal), bottom_right, scale, bool(deterministic), impl, variant,
                      alibi_slopes, learnable_sink)


def _no_dropout(dropout_p):
    if dropout_p != 0.0:
        raise L.FlashlmValueError(f"dropout_p: {dropout_p} given, but flashlm attention has no dropout (pass 0.0)")


def _variant(window_size, softcap):
    """(window_left, window_right, softcap) of flash-attn's window_size and softcap arguments; their bounds
    (window >= -1, softcap finite and >= 0) are checked by the library, as is a device without them."""
    if window_size is None:
        window_size = (-1, -1)
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise L.FlashlmValueError(f"window_size: expected a pair of ints (left, right), -1 for unbounded, got "
                                  f"{window_size!r}") from None
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        raise L.FlashlmValueError(f"softcap: expected a float (0.0 for none), got {softcap!r}") from None
    return left, right, cap


def _refuse_flash_attn_extras(return_attn_probs):
    """flash-attn's arguments for features flashlm does not have: an error unless each has its default."""
    if return_attn_probs:
        raise L.FlashlmValueError("return_attn_probs: flashlm attention does not return probabilities (pass False)")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None):
    """flash-attn's flash_attn_func: q [batch, seq_q, heads_q, head_dim], k [batch, seq_k, heads_k, head_dim], v
    [batch, seq_k, heads_k, head_dim_v] (head_dim_v may differ: the output takes it); causal is bottom-right
    aligned (query i sees keys j <= i + seq_k - seq_q), as in flash-attn >= 2.1. window_size = (left, right) and
    softcap as flash-attn's: query i sees key j iff i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right (-1
    unbounded; causal makes right 0), scores s become softcap * tanh(s / softcap) (0.0: off). alibi_slopes (float32
    [heads_q] or [batch, heads_q]): scores get -slope * |i + seq_k - seq_q - j|. learnable_sink (float32 [heads_q],
    flash-attn's cute interface; gpt-oss): a per-head logit in each row's softmax denominator, differentiable. The
    variants run on the CPU; on CUDA the window, softcap, ALiBi and sinks take fp16/bf16 tensors, and a
    head_dim_v of its own runs in both passes on the flash kernels (fp16/bf16/fp32, zero-padded to the next
    compiled head dim; on an sm_90 GPU the forward of head_dim 192 with head_dim_v 128 unpadded). Dropout and
    returned probabilities are not implemented and are refused."""
    if dropout_p != 0.0:
        _no_dropout(dropout_p)
    if return_attn_probs:
        _refuse_flash_attn_extras(return_attn_probs)
    variant = _NO_VARIANT if window_size == (-1, -1) and softcap == 0.0 else _variant(window_size, softcap)
    try:
        four_d = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    except AttributeError:  # not tensors: _check_4d says so
        four_d = False
    if not four_d:
        _check_4d(((q, "q"), (k, "k"), (v, "v")), "bshd")
    return _attention(q, k, v, "bshd", bool(causal), True, softmax_scale, bool(deterministic), "flash", variant,
                      alibi_slopes, learnable_sink)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's signature: [batch, heads, seq, head_dim] tensors,
    is_causal top-left aligned (query i sees keys j <= i). attn_mask and dropout are refused; heads_q !=
    heads_k needs enable_gqa=True, as in SDPA."""
    if attn_mask is not None:
        raise L.FlashlmValueError("attn_mask: flashlm attention takes no mask tensor (pass None; is_causal=True for "
                                  "a causal mask)")
    if dropout_p != 0.0:
        _no_dropout(dropout_p)
    try:
        four_d = query.dim() == 4 and key.dim() == 4 and value.dim() == 4
    except AttributeError:  # not tensors: _check_4d says so
        four_d = False
    if not four_d:
        _check_4d(((query, "query"), (key, "key"), (value, "value")), "bhsd")
    if not enable_gqa:
        heads = query.shape[1]
        if key.shape[1] != heads or value.shape[1] != heads:
            raise L.FlashlmValueError(f"enable_gqa: query has {heads} heads and key/value {key.shape[1]}/"
                                      f"{value.shape[1]}; pass enable_gqa=True for grouped-query attention")
    return _attention(query, key, value, "bhsd", bool(is_causal), False, scale, False, "flash")


def attention_forward(q, k, v, *, layout, causal=False, scale=None, causal_align=None, impl="flash"):
    """Forward only, no autograd: returns (o, lse) with o in q's layout and lse [batch, heads_q, seq_q]."""
    seq = _seq_dim(layout)
    _check_4d(((q, "q"), (k, "k"), (v, "v")), layout)
    return _forward(q, k, v, layout, bool(causal), _bottom_right(causal, causal_align, q.shape[seq], k.shape[seq]),
                    scale, False, impl)


def attention_backward(q, k, v, o, lse, dout, *, layout, causal=False, scale=None, causal_align=None,
                       deterministic=False, impl="flash"):
    """Backward only, no autograd: returns (dq, dk, dv) in the inputs' layout."""
    seq = _seq_dim(layout)
    _check_4d(((q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout")), layout)
    _require_tensor(lse, "lse")
    return _backward(dout, q, k, v, o, lse, layout, bool(causal),
                     _bottom_right(causal, causal_align, q.shape[seq], k.shape[seq]), scale, bool(deterministic), impl)


class FlashAttention(torch.autograd.Function):
    """The CS336 interface: FlashAttention.apply(q, k, v, is_causal) on 3-D (batch, seq, head_dim) tensors,
    one head. Saves q, k, v, o and the logsumexp shaped (batch, seq_q) for the backward, nothing larger."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise L.FlashlmValueError(f"{name}: expected 3 dimensions (batch, seq, head_dim), got {tuple(t.shape)}")
        o, lse = _forward(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), "bshd", bool(is_causal), False, None, False,
                          "flash")
        ctx.save_for_backward(q, k, v, o.squeeze(2), lse.squeeze(1))  # lse (batch, seq_q)
        ctx.is_causal = bool(is_causal)
        return o.squeeze(2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.unsqueeze(2), q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), o.unsqueeze(2),
                               lse.unsqueeze(1), "bshd", ctx.is_causal, False, None, False, "flash")
        return (*_once_differentiable((dq.squeeze(2), dk.squeeze(2), dv.squeeze(2)), (q, k, v, dout)), None)


# Packed variable-length sequences (flash-attn's varlen convention): q [total_q, heads_q, head_dim], k, v
# [total_k, heads_k, head_dim], int32 offsets cu_seqlens_q/k [batch + 1], lse [heads_q, total_q].
#
#     torch.ops.flashlm.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
#                                            causal, bottom_right, scale, deterministic, impl) -> (o, lse)
#     torch.ops.flashlm.attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
#                                            max_seqlen_k, causal, bottom_right, scale, deterministic, impl)
#         -> (dq, dk, dv)

def _describe3(t):
    return (t.data_ptr(), 3, _DTYPES[t.dtype], t.is_cuda, *t.shape, *t.stride())


def _describe_lse2(t):
    return (t.data_ptr(), 2, _DTYPES[t.dtype], t.is_cuda, *t.shape, *t.stride())


def _check_offsets(cu_seqlens_q, cu_seqlens_k, q):
    """The offsets as the C side reads them (int32, one dimension, unit stride, on q's device or the CPU);
    their values are checked there. Returns (cu_q, cu_k, batch)."""
    named = ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"))
    for t, name in named:
        if not isinstance(t, torch.Tensor):
            raise L.FlashlmValueError(f"{name}: expected an int32 tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise L.FlashlmValueError(f"{name}: expected dtype torch.int32 (flash-attn's convention), got {t.dtype}")
        if t.dim() != 1 or t.numel() == 0:
            raise L.FlashlmValueError(f"{name}: expected one dimension of batch + 1 >= 1 offsets, got shape "
                                      f"{tuple(t.shape)}")
        if t.is_cuda and (not q.is_cuda or t.device != q.device):
            raise L.FlashlmValueError(f"{name}: on {t.device} but q is on {q.device} (offsets go on q's device or "
                                      "the CPU)")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise L.FlashlmValueError(f"cu_seqlens_k: {cu_seqlens_k.numel()} offsets, but cu_seqlens_q has "
                                  f"{cu_seqlens_q.numel()} (both are batch + 1 long)")
    return cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), cu_seqlens_q.numel() - 1


def _varlen_fields(cu_q, cu_k, batch, max_seqlen_q, max_seqlen_k):
    return (cu_q.data_ptr(), cu_k.data_ptr(), batch, cu_q.is_cuda, int(max_seqlen_q), int(max_seqlen_k))


def _varlen_forward_outputs(q, v=None):
    """o (like q with v's head dim) and lse [heads_q, total_q]."""
    if q.dim() != 3:
        raise L.FlashlmValueError(f"q: expected 3 dimensions [total_q, heads_q, head_dim], got shape {tuple(q.shape)}")
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q), device=q.device)
    if isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[2] != q.shape[2]:
        return torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device), lse
    return torch.empty_like(q), lse


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, bottom_right, scale,
                    deterministic, impl, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                    learnable_sink=None):
    cu_q, cu_k, batch = _check_offsets(cu_seqlens_q, cu_seqlens_k, q)
    _check_extras(alibi_slopes, learnable_sink)
    o, lse = _varlen_forward_outputs(q, v)
    _check_3d(((k, "k"), (v, "v")))
    try:
        fields = (_describe3(q) + _describe3(k) + _describe3(v) + _describe3(o) + _describe_lse2(lse)
                  + _varlen_fields(cu_q, cu_k, batch, max_seqlen_q, max_seqlen_k)
                  + _options(causal, bottom_right, scale, deterministic, impl))
    except (KeyError, IndexError, TypeError, AttributeError):
        raise _why_not_packable(((q, "q"), (k, "k"), (v, "v")), impl, 3) from None
    try:
        _call(L.varlen_forward, q, fields, (window_left, window_right, softcap), (alibi_slopes, learnable_sink, None))
    except struct.error:
        raise _why_not_packable(((q, "q"), (k, "k"), (v, "v")), impl, 3) from None
    return o, lse


def _varlen_backward(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     bottom_right, scale, deterministic, impl, window_left=-1, window_right=-1, softcap=0.0,
                     alibi_slopes=None, learnable_sink=None):
    """(dq, dk, dv, dsink): dsink the sink's gradient summed over the sequences (empty without a sink)."""
    named = ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout"))
    _check_3d(named)
    cu_q, cu_k, batch = _check_offsets(cu_seqlens_q, cu_seqlens_k, q)
    _check_extras(alibi_slopes, learnable_sink)
    if dout.stride(-1) != 1 or dout.numel() == 0:
        dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device).copy_(dout)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = _sink_grad_like(learnable_sink, q)
    try:
        fields = (_describe3(q) + _describe3(k) + _describe3(v) + _describe3(o) + _describe_lse2(lse)
                  + _describe3(dout) + _describe3(dq) + _describe3(dk) + _describe3(dv)
                  + _varlen_fields(cu_q, cu_k, batch, max_seqlen_q, max_seqlen_k)
                  + _options(causal, bottom_right, scale, deterministic, impl))
    except (KeyError, IndexError, TypeError, AttributeError):
        raise _why_not_packable(named + ((lse, "lse"),), impl, 3) from None
    try:
        _call(L.varlen_backward, q, fields, (window_left, window_right, softcap),
              (alibi_slopes, learnable_sink, dsink if learnable_sink is not None else None))
    except struct.error:
        raise _why_not_packable(named + ((lse, "lse"),), impl, 3) from None
    return dq, dk, dv, dsink


def _check_3d(named_tensors):
    for t, name in named_tensors:
        _require_tensor(t, name)
        if t.dim() != 3:
            raise L.FlashlmValueError(f"{name}: expected 3 dimensions [total, heads, head_dim] (packed sequences), "
                                      f"got shape {tuple(t.shape)}")


if HAS_CUSTOM_OPS:
    @torch.library.custom_op("flashlm::attention_varlen_fwd", mutates_args=())
    def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                             bottom_right: bool, scale: Optional[float], deterministic: bool, impl: str,
                             window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None,
                             learnable_sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Packed variable-length attention forward: (o, lse [heads_q, total_q])."""
        return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, bottom_right,
                               scale, deterministic, impl, window_left, window_right, softcap, alibi_slopes,
                               learnable_sink)

    @attention_varlen_fwd.register_fake
    def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   bottom_right, scale, deterministic, impl, window_left=-1, window_right=-1,
                                   softcap=0.0, alibi_slopes=None, learnable_sink=None):
        return _varlen_forward_outputs(q, v)

    @torch.library.custom_op("flashlm::attention_varlen_bwd", mutates_args=())
    def attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, causal: bool, bottom_right: bool,
                             scale: Optional[float], deterministic: bool, impl: str,
                             window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None,
                             learnable_sink: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed variable-length attention backward: (dq, dk, dv, dsink), dq, dk, dv allocated like q, k, v; dsink
        the sink's gradient summed over the sequences (empty without a learnable_sink)."""
        return _varlen_backward(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                bottom_right, scale, deterministic, impl, window_left, window_right, softcap,
                                alibi_slopes, learnable_sink)

    @attention_varlen_bwd.register_fake
    def _attention_varlen_bwd_fake(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   causal, bottom_right, scale, deterministic, impl, window_left=-1, window_right=-1,
                                   softcap=0.0, alibi_slopes=None, learnable_sink=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _sink_grad_like(learnable_sink, q)

    def _varlen_setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k = inputs[:5]
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, *inputs[15:17])  # alibi_slopes, learnable_sink
        ctx.args = inputs[5:15]  # max_seqlen_q/k, causal, bottom_right, scale, deterministic, impl, window, softcap
        ctx.mark_non_differentiable(lse)

    def _varlen_fwd_backward(ctx, dout, dlse):
        q, k, v, o, lse, cu_q, cu_k, alibi_slopes, learnable_sink = ctx.saved_tensors
        if torch.is_grad_enabled():
            dq, dk, dv, dsink = _VarlenBackwardOps.apply(dout, q, k, v, o, lse, cu_q, cu_k, *ctx.args, alibi_slopes,
                                                         learnable_sink)
        else:
            dq, dk, dv, dsink = _VARLEN_BWD_OP(dout, q, k, v, o, lse, cu_q, cu_k, *ctx.args, alibi_slopes,
                                               learnable_sink)
        return (dq, dk, dv, *([None] * 13), dsink if learnable_sink is not None else None)

    attention_varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_varlen_setup_context)
    attention_varlen_bwd.register_autograd(_refuse_double_backward)
    _VARLEN_FWD_OP = torch.ops.flashlm.attention_varlen_fwd.default
    _register_autocast(_VARLEN_FWD_OP, "attention_varlen_fwd")
    _VARLEN_BWD_OP = torch.ops.flashlm.attention_varlen_bwd.default

    class _VarlenOps(torch.autograd.Function):
        """The varlen operators' autograd formula as an autograd.Function (for torch.func, as _AttentionOps)."""

        @staticmethod
        def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic, impl, window_left,
                    window_right, softcap, alibi_slopes, learnable_sink):
            return _VARLEN_FWD_OP(q, k, v, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic, impl,
                                  window_left, window_right, softcap, alibi_slopes, learnable_sink)

        setup_context = staticmethod(_varlen_setup_context)
        backward = staticmethod(_varlen_fwd_backward)

    class _VarlenBackwardOps(torch.autograd.Function):
        @staticmethod
        def forward(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic,
                    impl, window_left, window_right, softcap, alibi_slopes, learnable_sink):
            return _VARLEN_BWD_OP(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale,
                                  deterministic, impl, window_left, window_right, softcap, alibi_slopes,
                                  learnable_sink)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        backward = staticmethod(_refuse_double_backward)


class _VarlenAttention(torch.autograd.Function):
    """The eager autograd path of the varlen attention (as _Attention for the batched one)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic, impl, window_left,
                window_right, softcap, alibi_slopes=None, learnable_sink=None):
        o, lse = _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic, impl,
                                 window_left, window_right, softcap, alibi_slopes, learnable_sink)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi_slopes, learnable_sink)
        ctx.args = (max_q, max_k, causal, bottom_right, scale, deterministic, impl, window_left, window_right, softcap)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse, cu_q, cu_k, alibi_slopes, learnable_sink = ctx.saved_tensors
        *grads, dsink = _varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, *ctx.args, alibi_slopes, learnable_sink)
        return (*_once_differentiable(tuple(grads), (q, k, v, dout)), *([None] * 13),
                dsink if learnable_sink is not None else None)


def _varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic, impl,
                      variant=_NO_VARIANT, alibi_slopes=None, learnable_sink=None):
    q, k, v = _autocast_qkv(q, k, v)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, bottom_right, scale, deterministic, impl, *variant,
            alibi_slopes, learnable_sink)
    if _traced(q):
        # Dynamo refuses an autograd.Function given one tensor twice, and self-attention passes the same
        # offsets as cu_q and cu_k: compiled code calls the operator (its registered autograd), torch.func
        # transforms the autograd.Function (the operator's autograd is not usable under them).
        if torch.compiler.is_compiling():
            return _VARLEN_FWD_OP(*args)[0]
        return _VarlenOps.apply(*args)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        return _VarlenAttention.apply(*args)
    return _varlen_forward(*args)[0]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, causal_align=None,
                           learnable_sink=None):
    """flash-attn's flash_attn_varlen_func: the batch's sequences packed end to end, q [total_q, heads_q,
    head_dim], k, v [total_k, heads_k, head_dim], sequence b owning rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q
    and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k (int32 tensors of batch + 1 offsets, on q's device or the CPU;
    offsets on the GPU are read back once per call). max_seqlen_q/k bound the sequence lengths (a longer
    sequence is an error). causal applies per sequence, bottom-right aligned as in flash-attn >= 2.1
    (causal_align="top_left" for PyTorch's alignment; the sliding window aligns with it). window_size and
    softcap as in flash_attn_func, per sequence; alibi_slopes ([heads_q] or [batch, heads_q], batch the number of
    sequences) and learnable_sink ([heads_q], its gradient summed over the sequences) likewise; v [total_k, heads_k,
    head_dim_v]. Dropout, returned probabilities and paged KV (block_table) are refused."""
    _no_dropout(dropout_p)
    _refuse_flash_attn_extras(return_attn_probs)
    variant = _variant(window_size, softcap)
    if block_table is not None:
        raise L.FlashlmValueError("block_table: flashlm attention has no paged KV cache (pass None)")
    _check_3d(((q, "q"), (k, "k"), (v, "v")))
    if causal_align is None:
        bottom_right = True
    elif causal_align in _ALIGN:
        bottom_right = _ALIGN[causal_align]
    else:
        raise L.FlashlmValueError(f"causal_align: '{causal_align}' is not top_left or bottom_right")
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal),
                             bottom_right, softmax_scale, bool(deterministic), "flash", variant, alibi_slopes,
                             learnable_sink)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                             scale=None, causal_align="bottom_right", impl="flash"):
    """Varlen forward only, no autograd: returns (o, lse) with lse [heads_q, total_q] (flash-attn's layout)."""
    _check_3d(((q, "q"), (k, "k"), (v, "v")))
    if causal_align not in _ALIGN:
        raise L.FlashlmValueError(f"causal_align: '{causal_align}' is not top_left or bottom_right")
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal),
                           _ALIGN[causal_align], scale, False, impl)


# ---- decoding over a KV cache (flash-attn's flash_attn_with_kvcache) --------------------------------------
#     torch.ops.flashlm.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
#                                              causal, scale, window_left, window_right, softcap) -> (o, lse)
# mutates k_cache and v_cache (the in-place append of k_new / v_new at cache_seqlens). o is a new contiguous
# [batch, nq, heads_q, head_dim] tensor, lse [batch, heads_q, nq] float32 (float64 for float64 CPU inputs).
# Nothing is read back to the host and the outputs' sizes follow from the shapes alone, so the call can be
# captured in a CUDA graph.

_ABSENT_TENSOR4 = (0,) * 12  # a flashlm_tensor slot passed as NULL (data, ndim, dtype, device, sizes, strides)


def _kvcache_outputs(q):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q), device=q.device))


def _check_index_tensor(t, name, q, ndim, batch):
    """cache_seqlens / block_table as the C side reads them: int32 on q's device, `batch` rows, a unit last
    stride. The C ABI gets only their pointers, so their extent is checked here."""
    if not isinstance(t, torch.Tensor):
        raise L.FlashlmValueError(f"{name}: expected an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise L.FlashlmValueError(f"{name}: expected dtype torch.int32 (flash-attn's convention), got {t.dtype}")
    if t.dim() != ndim or t.shape[0] != batch:
        want = "[batch]" if ndim == 1 else "[batch, max_pages]"
        raise L.FlashlmValueError(f"{name}: expected shape {want} with batch = {batch}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise L.FlashlmValueError(f"{name}: on {t.device} but q is on {q.device} (the index tensors go on q's device)")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise L.FlashlmValueError(f"{name}: the last dimension must have stride 1, got strides {t.stride()}")


def _kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale, window_left,
                     window_right, softcap):
    named = [(q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")]
    if (k_new is None) != (v_new is None):
        raise L.FlashlmValueError("k, v: give both new tensors (appended to the cache) or neither")
    has_new = k_new is not None
    if has_new:
        named += [(k_new, "k"), (v_new, "v")]
    for t, name in named:
        _require_tensor(t, name)
        if t.dim() != 4:
            raise L.FlashlmValueError(f"{name}: expected 4 dimensions, got shape {tuple(t.shape)}")
    batch = q.shape[0]
    _check_index_tensor(cache_seqlens, "cache_seqlens", q, 1, batch)
    if block_table is not None:
        _check_index_tensor(block_table, "block_table", q, 2, batch)
        table = (block_table.data_ptr(), block_table.shape[1], max(block_table.stride(0), block_table.shape[1]))
    else:
        table = (0, 0, 0)
    o, lse = _kvcache_outputs(q)
    try:
        fields = (_describe(q, False) + _describe(k_cache, False) + _describe(v_cache, False)
                  + (_describe(k_new, False) if has_new else _ABSENT_TENSOR4)
                  + (_describe(v_new, False) if has_new else _ABSENT_TENSOR4)
                  + _describe(o, False) + _describe_lse(lse) + (cache_seqlens.data_ptr(), *table)
                  + _options(causal, True, scale, False, "flash"))
    except (KeyError, IndexError, TypeError, AttributeError):
        raise _why_not_packable(named, "flash", 4, scale) from None

    def run(*packed, extras):  # (no ALiBi or sink in the decoding call: their option pointers stay NULL)
        L.with_kvcache(has_new, True, *packed, *_NO_EXTRA_POINTERS)

    try:
        _call(run, q, fields, (window_left, window_right, softcap))
    except struct.error:
        raise _why_not_packable(named, "flash", 4, scale) from None
    return o, lse


if HAS_CUSTOM_OPS:
    @torch.library.custom_op("flashlm::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
    def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                               k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], causal: bool,
                               scale: Optional[float], window_left: int = -1, window_right: int = -1,
                               softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Decoding attention over a (paged) KV cache, appending k_new / v_new into it first: (o, lse)."""
        return _kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale,
                                window_left, window_right, softcap)

    @attention_with_kvcache.register_fake
    def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale,
                                     window_left=-1, window_right=-1, softcap=0.0):
        return _kvcache_outputs(q)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's flash_attn_with_kvcache: q [batch, nq, heads_q, head_dim]; k_cache, v_cache
    [batch, max_seq, heads_k, head_dim], or paged [num_pages, page_size, heads_k, head_dim] with block_table
    [batch, max_pages] int32 (page_size a multiple of 16 in [16, 256]); cache_seqlens [batch] int32 (or an int)
    the lengths before the append; k, v [batch, seq_new, heads_k, head_dim] written IN PLACE into the cache at
    cache_seqlens before attending. causal and window_size are aligned bottom-right (the queries are the last
    nq positions of each sequence), softcap as in flash_attn_func. Returns out, or (out, softmax_lse) with
    return_softmax_lse. Rotary embedding, cache_batch_idx, cache_leftpad and ALiBi are not implemented and are
    refused; num_splits must be 0 (chosen by the library). No autograd (decoding is inference)."""
    for value, name, default in ((rotary_cos, "rotary_cos", None), (rotary_sin, "rotary_sin", None),
                                 (cache_batch_idx, "cache_batch_idx", None), (cache_leftpad, "cache_leftpad", None),
                                 (alibi_slopes, "alibi_slopes", None)):
        if value is not default:
            raise L.FlashlmValueError(f"{name}: not supported by flashlm's flash_attn_with_kvcache (pass None)")
    if num_splits != 0:
        raise L.FlashlmValueError(f"num_splits: flashlm chooses the splits itself (pass 0), got {num_splits}")
    _require_tensor(q, "q")
    if cache_seqlens is None:
        raise L.FlashlmValueError("cache_seqlens: required (an int32 tensor [batch] or an int: the cache lengths "
                                  "before the append)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right, cap = _variant(window_size, softcap)
    if HAS_CUSTOM_OPS:
        out, lse = torch.ops.flashlm.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k, v,
                                                            bool(causal), softmax_scale, left, right, cap)
    else:
        out, lse = _kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, k, v, bool(causal),
                                    softmax_scale, left, right, cap)
    return (out, lse) if return_softmax_lse else out
