"""PyTorch front end: tensors in, tensors out, through the C ABI (no compiled extension)."""
import contextlib
import ctypes

import torch

from . import _lib as L

_DTYPES = {torch.float64: L.FP64, torch.float32: L.FP32, torch.float16: L.FP16, torch.bfloat16: L.BF16}
_ALIGN = {"top_left": L.TOP_LEFT, "top-left": L.TOP_LEFT, "bottom_right": L.BOTTOM_RIGHT,
          "bottom-right": L.BOTTOM_RIGHT}
_IMPL = {"flash": L.FLASH, "naive": L.NAIVE}


def _c_tensor(t, name):
    if t.dtype not in _DTYPES:
        raise L.FlashlmValueError(f"{name}: dtype {t.dtype} is not supported (float64, float32, float16, bfloat16)")
    if t.device.type not in ("cpu", "cuda"):
        raise L.FlashlmValueError(f"{name}: device {t.device} is not supported (cpu or cuda)")
    if t.dim() > L.MAX_DIMS:
        raise L.FlashlmValueError(f"{name}: {t.dim()} dimensions, at most {L.MAX_DIMS}")
    c = L.Tensor()
    c.data = t.data_ptr() or None
    c.ndim = t.dim()
    c.dtype = _DTYPES[t.dtype]
    c.device = L.CPU if t.device.type == "cpu" else L.CUDA
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        c.sizes[i] = size
        c.strides[i] = stride
    return c


def _options(causal, scale, causal_align, deterministic, impl, device):
    if causal_align not in _ALIGN:
        raise L.FlashlmValueError(f"causal_align: '{causal_align}' is not top_left or bottom_right")
    if impl not in _IMPL:
        raise L.FlashlmValueError(f"impl: '{impl}' is not flash or naive")
    o = L.AttentionOptions()
    o.impl = _IMPL[impl]
    o.causal = int(bool(causal))
    o.causal_align = _ALIGN[causal_align]
    o.deterministic = int(bool(deterministic))
    o.has_scale = int(scale is not None)
    o.scale = float(scale) if scale is not None else 0.0
    o.stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    return o


def _device_of(*tensors):
    return tensors[0].device


def _on_device(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _bshd(t, layout, name):
    """The [batch, seq, heads, head_dim] view of a tensor given in `layout` (no copy)."""
    if t.dim() != 4:
        raise L.FlashlmValueError(f"{name}: expected 4 dimensions ({layout}), got shape {tuple(t.shape)}")
    if layout == "bshd":
        return t
    if layout == "bhsd":
        return t.transpose(1, 2)
    raise L.FlashlmValueError(f"layout: '{layout}' is not bshd or bhsd")


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 and q.device.type == "cpu" else torch.float32


def attention_forward(q, k, v, *, causal=False, scale=None, causal_align="top_left", layout="bshd", impl="flash"):
    """Forward only, no autograd: returns (o, lse) with o in q's layout and lse [batch, heads_q, seq_q]."""
    qb, kb, vb = _bshd(q, layout, "q"), _bshd(k, layout, "k"), _bshd(v, layout, "v")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((qb.shape[0], qb.shape[2], qb.shape[1]), dtype=_lse_dtype(q), device=q.device)
    device = _device_of(q)
    with _on_device(device):
        opts = _options(causal, scale, causal_align, False, impl, device)
        L.check(L.lib.flashlm_attention_forward(
            ctypes.byref(_c_tensor(qb, "q")), ctypes.byref(_c_tensor(kb, "k")), ctypes.byref(_c_tensor(vb, "v")),
            ctypes.byref(_c_tensor(_bshd(o, layout, "o"), "o")), ctypes.byref(_c_tensor(lse, "lse")),
            ctypes.byref(opts)))
    return o, lse


def attention_backward(q, k, v, o, lse, dout, *, causal=False, scale=None, causal_align="top_left", layout="bshd",
                       deterministic=False, impl="flash"):
    """Backward only, no autograd: returns (dq, dk, dv) in the inputs' layout."""
    if dout.stride(-1) != 1 or dout.numel() == 0:
        # .sum().backward() hands an expanded (stride 0) gradient; an empty one keeps its zero strides
        # through .contiguous(), so it gets fresh ones.
        dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device).copy_(dout)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    device = _device_of(q)
    views = [_bshd(t, layout, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"))]
    grads = [_bshd(t, layout, n) for t, n in ((dout, "dout"), (dq, "dq"), (dk, "dk"), (dv, "dv"))]
    with _on_device(device):
        opts = _options(causal, scale, causal_align, deterministic, impl, device)
        c = [_c_tensor(t, n) for t, n in zip(views, ("q", "k", "v", "o"))]
        g = [_c_tensor(t, n) for t, n in zip(grads, ("dout", "dq", "dk", "dv"))]
        L.check(L.lib.flashlm_attention_backward(
            *(ctypes.byref(x) for x in c), ctypes.byref(_c_tensor(lse, "lse")), *(ctypes.byref(x) for x in g),
            ctypes.byref(opts)))
    return dq, dk, dv


class _NoDoubleBackward(torch.autograd.Function):
    """Copies the gradients, as functions of the attention's inputs whose own backward (a double backward)
    raises a clear error instead of torch's "does not require grad"."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *inputs):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError("flashlm attention: double backward (differentiating the attention's gradients, "
                           "create_graph=True) is not supported")


def _once_differentiable(grads, inputs):
    """The gradients; under create_graph=True (grad mode on inside backward) tied to `inputs` through a
    node that refuses to be differentiated."""
    if not torch.is_grad_enabled():
        return grads
    return _NoDoubleBackward.apply(*grads, *inputs)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, causal_align, layout, deterministic, impl):
        o, lse = attention_forward(q, k, v, causal=causal, scale=scale, causal_align=causal_align, layout=layout,
                                   impl=impl)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = dict(causal=causal, scale=scale, causal_align=causal_align, layout=layout,
                        deterministic=deterministic, impl=impl)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _once_differentiable(attention_backward(q, k, v, o, lse, dout, **ctx.args), (q, k, v, dout))
        return dq, dk, dv, None, None, None, None, None, None


def attention(q, k, v, *, causal=False, scale=None, causal_align="top_left", layout="bshd", deterministic=False,
              impl="flash"):
    """Scaled dot-product attention with flashlm's kernels, differentiable.

    q [batch, seq_q, heads_q, head_dim] and k, v [batch, seq_k, heads_k, head_dim] (layout="bshd"), or
    [batch, heads, seq, head_dim] (layout="bhsd", like F.scaled_dot_product_attention); heads_q a
    multiple of heads_k (GQA). Any strides with a unit last stride; CPU or CUDA tensors (the current
    CUDA stream is used); float32/float16/bfloat16 (float64 on the CPU). causal_align "top_left" is
    PyTorch's is_causal; "bottom_right" is FlashAttention's (for decoding with seq_q < seq_k).
    """
    return _Attention.apply(q, k, v, causal, scale, causal_align, layout, deterministic, impl)


class FlashAttention(torch.autograd.Function):
    """The CS336 interface: FlashAttention.apply(q, k, v, is_causal) on 3-D (batch, seq, head_dim) tensors,
    one head. Saves q, k, v, o and the logsumexp shaped (batch, seq_q) for the backward, nothing larger."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise L.FlashlmValueError(f"{name}: expected 3 dimensions (batch, seq, head_dim), got {tuple(t.shape)}")
        o, lse = attention_forward(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), causal=bool(is_causal))
        lse = lse.squeeze(1)  # (batch, seq_q)
        o = o.squeeze(2)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), o.unsqueeze(2),
                                        lse.unsqueeze(1), dout.unsqueeze(2), causal=ctx.is_causal)
        dq, dk, dv = _once_differentiable((dq.squeeze(2), dk.squeeze(2), dv.squeeze(2)), (q, k, v, dout))
        return dq, dk, dv, None
