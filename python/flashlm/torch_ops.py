"""PyTorch front end: flashlm's attention as torch.library custom operators (torch >= 2.4), or as a plain
autograd.Function on older torch, through the C ABI (no compiled extension).

    torch.ops.flashlm.attention_fwd(q, k, v, causal, bottom_right, scale, deterministic, impl) -> (o, lse)
    torch.ops.flashlm.attention_bwd(dout, q, k, v, o, lse, causal, bottom_right, scale, deterministic, impl)
        -> (dq, dk, dv)

The operators take [batch, seq, heads, head_dim] tensors (any strides with a unit last stride: a
transposed [batch, heads, seq, head_dim] tensor is such a view). o is allocated like q (same strides when q
is dense), lse is [batch, heads_q, seq_q] float32 (float64 for float64 CPU inputs). The C side checks every
argument; Python only describes the tensors to it.
"""
import struct
from typing import Optional, Tuple

import torch

from . import _lib as L

_DTYPES = {torch.float64: L.FP64, torch.float32: L.FP32, torch.float16: L.FP16, torch.bfloat16: L.BF16}
_ALIGN = {"top_left": False, "top-left": False, "bottom_right": True, "bottom-right": True}
_IMPL = {"flash": L.FLASH, "naive": L.NAIVE}
DOUBLE_BACKWARD_ERROR = ("flashlm attention: double backward (differentiating the attention's gradients, "
                         "create_graph=True) is not supported")

# The current stream as an integer without building a torch.cuda.Stream object (a few µs per call).
if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream
else:
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _describe(t, name):
    """The packed flashlm_tensor fields of t (data, ndim, dtype, device, sizes, strides)."""
    try:
        dtype = _DTYPES[t.dtype]
    except KeyError:
        raise L.FlashlmValueError(f"{name}: dtype {t.dtype} is not supported (float64, float32, float16, "
                                  "bfloat16)") from None
    return (t.data_ptr(), t.dim(), dtype, L.CUDA if t.is_cuda else L.CPU, *t.shape, *t.stride())


def _options(causal, bottom_right, scale, deterministic, impl):
    """The packed flashlm_attention_options fields, less the stream."""
    try:
        code = _IMPL[impl]
    except KeyError:
        raise L.FlashlmValueError(f"impl: '{impl}' is not flash or naive") from None
    return (code, int(causal), int(bottom_right), int(deterministic), int(scale is not None),
            0.0 if scale is None else float(scale))


def _call(c_function, q, named_tensors, options):
    """Packs the tensors and options (plus q's current CUDA stream) and calls the C function on q's device."""
    fields = [field for t, name in named_tensors for field in _describe(t, name)]
    if not q.is_cuda:
        return _pack_and_call(c_function, named_tensors, fields, options, 0)
    index = q.get_device()
    if torch.cuda.current_device() == index:
        return _pack_and_call(c_function, named_tensors, fields, options, _raw_stream(index))
    with torch.cuda.device(index):  # the C ABI works on the calling thread's current device
        return _pack_and_call(c_function, named_tensors, fields, options, _raw_stream(index))


def _pack_and_call(c_function, named_tensors, fields, options, stream):
    try:
        c_function(*fields, *options, stream)
    except struct.error:
        # The packed layout has room for 4-dimensional tensors (3 for lse): name the one that is not.
        for t, name in named_tensors:
            want = 3 if name == "lse" else 4
            if t.dim() != want:
                raise L.FlashlmValueError(f"{name}: expected {want} dimensions, got shape {tuple(t.shape)}") from None
        raise


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 and not q.is_cuda else torch.float32


def _forward_outputs(q):
    """o (like q) and lse [batch, heads_q, seq_q], allocated as the operator's real and fake kernels both do."""
    if q.dim() != 4:
        raise L.FlashlmValueError(f"q: expected 4 dimensions [batch, seq, heads, head_dim], got shape {tuple(q.shape)}")
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))


def _forward(q, k, v, causal, bottom_right, scale, deterministic, impl):
    o, lse = _forward_outputs(q)
    _call(L.forward, q, ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse")),
          _options(causal, bottom_right, scale, deterministic, impl))
    return o, lse


def _backward(dout, q, k, v, o, lse, causal, bottom_right, scale, deterministic, impl):
    if dout.stride(-1) != 1 or dout.numel() == 0:
        # .sum().backward() hands an expanded (stride 0) gradient; an empty one keeps its zero strides
        # through .contiguous(), so it gets fresh ones.
        dout = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device).copy_(dout)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call(L.backward, q, ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"), (dout, "dout"), (dq, "dq"),
                          (dk, "dk"), (dv, "dv")),
          _options(causal, bottom_right, scale, deterministic, impl))
    return dq, dk, dv


HAS_CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")

if HAS_CUSTOM_OPS:
    @torch.library.custom_op("flashlm::attention_fwd", mutates_args=())
    def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bottom_right: bool,
                      scale: Optional[float], deterministic: bool, impl: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention forward on [batch, seq, heads, head_dim] views: (o, lse). `deterministic` is the
        backward's (it is an input so that the registered autograd formula sees it)."""
        return _forward(q, k, v, causal, bottom_right, scale, deterministic, impl)

    @attention_fwd.register_fake
    def _attention_fwd_fake(q, k, v, causal, bottom_right, scale, deterministic, impl):
        return _forward_outputs(q)

    @torch.library.custom_op("flashlm::attention_bwd", mutates_args=())
    def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, causal: bool, bottom_right: bool, scale: Optional[float], deterministic: bool,
                      impl: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention backward on the forward's tensors and dO: (dq, dk, dv), allocated like q, k, v."""
        return _backward(dout, q, k, v, o, lse, causal, bottom_right, scale, deterministic, impl)

    @attention_bwd.register_fake
    def _attention_bwd_fake(dout, q, k, v, o, lse, causal, bottom_right, scale, deterministic, impl):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v, causal, bottom_right, scale, deterministic, impl = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, bottom_right, scale, deterministic, impl)
        ctx.mark_non_differentiable(lse)

    def _fwd_backward(ctx, dout, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True, or under a torch.func transform
            dq, dk, dv = _AttentionBackwardOps.apply(dout, q, k, v, o, lse, *ctx.args)
        else:
            dq, dk, dv = _BWD_OP(dout, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None

    def _refuse_double_backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)

    attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
    attention_bwd.register_autograd(_refuse_double_backward)
    _FWD_OP = torch.ops.flashlm.attention_fwd.default
    _BWD_OP = torch.ops.flashlm.attention_bwd.default

    class _AttentionOps(torch.autograd.Function):
        """The operators' autograd formula as an autograd.Function with setup_context, which torch.func
        transforms (grad, vjp) accept; the op's own registered autograd (the same formula, for callers of
        torch.ops.flashlm directly) is not usable under them in torch <= 2.15."""

        @staticmethod
        def forward(q, k, v, causal, bottom_right, scale, deterministic, impl):
            return _FWD_OP(q, k, v, causal, bottom_right, scale, deterministic, impl)

        setup_context = staticmethod(_fwd_setup_context)
        backward = staticmethod(_fwd_backward)

    class _AttentionBackwardOps(torch.autograd.Function):
        """The backward operator where its result could be differentiated again: that raises the clear
        error (the op's registered refusal is not reachable under torch.func transforms)."""

        @staticmethod
        def forward(dout, q, k, v, o, lse, causal, bottom_right, scale, deterministic, impl):
            return _BWD_OP(dout, q, k, v, o, lse, causal, bottom_right, scale, deterministic, impl)

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
    """The autograd path for torch without torch.library.custom_op (Debian's 1.13, say)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, bottom_right, scale, deterministic, impl):
        o, lse = _forward(q, k, v, causal, bottom_right, scale, deterministic, impl)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, bottom_right, scale, deterministic, impl)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        grads = _once_differentiable(_backward(dout, q, k, v, o, lse, *ctx.args), (q, k, v, dout))
        return (*grads, None, None, None, None, None)


def _attention_bshd(q, k, v, causal, bottom_right, scale, deterministic, impl):
    if HAS_CUSTOM_OPS:
        return _AttentionOps.apply(q, k, v, causal, bottom_right, scale, deterministic, impl)[0]
    return _Attention.apply(q, k, v, causal, bottom_right, scale, deterministic, impl)


def _bshd(t, layout, name):
    """The [batch, seq, heads, head_dim] view of a tensor given in `layout` (no copy)."""
    if t.dim() != 4:
        raise L.FlashlmValueError(f"{name}: expected 4 dimensions ({layout}), got shape {tuple(t.shape)}")
    if layout == "bshd":
        return t
    if layout == "bhsd":
        return t.transpose(1, 2)
    raise L.FlashlmValueError(f"layout: '{layout}' is not bshd or bhsd")


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


def attention(q, k, v, *, layout, causal=False, scale=None, causal_align=None, deterministic=False, impl="flash"):
    """Scaled dot-product attention with flashlm's kernels, differentiable (first order).

    layout (required): "bshd" for q [batch, seq_q, heads_q, head_dim] and k, v [batch, seq_k, heads_k,
    head_dim], or "bhsd" for [batch, heads, seq, head_dim] (F.scaled_dot_product_attention's). heads_q a
    multiple of heads_k (GQA). Any strides with a unit last stride; CPU or CUDA tensors (the current CUDA
    stream is used); float32/float16/bfloat16 (float64 on the CPU). causal_align "top_left" is PyTorch's
    is_causal, "bottom_right" flash-attn's; it must be given for a causal mask with seq_q != seq_k.
    flash_attn_func and scaled_dot_product_attention take those libraries' signatures.
    """
    qb, kb, vb = _bshd(q, layout, "q"), _bshd(k, layout, "k"), _bshd(v, layout, "v")
    bottom_right = _bottom_right(causal, causal_align, qb.shape[1], kb.shape[1])
    o = _attention_bshd(qb, kb, vb, bool(causal), bottom_right, scale, bool(deterministic), impl)
    return o if layout == "bshd" else o.transpose(1, 2)


def _no_dropout(dropout_p):
    if dropout_p != 0.0:
        raise L.FlashlmValueError(f"dropout_p: {dropout_p} given, but flashlm attention has no dropout (pass 0.0)")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's flash_attn_func: q [batch, seq_q, heads_q, head_dim], k, v [batch, seq_k, heads_k,
    head_dim]; causal is bottom-right aligned (query i sees keys j <= i + seq_k - seq_q), as in
    flash-attn >= 2.1. Dropout, sliding windows, softcap, ALiBi and returned probabilities are not
    implemented and are refused."""
    _no_dropout(dropout_p)
    if tuple(window_size) != (-1, -1):
        raise L.FlashlmValueError(f"window_size: {tuple(window_size)} given, but flashlm attention has no sliding "
                                  "window (pass (-1, -1))")
    if softcap != 0.0:
        raise L.FlashlmValueError(f"softcap: {softcap} given, but flashlm attention has no softcap (pass 0.0)")
    if alibi_slopes is not None:
        raise L.FlashlmValueError("alibi_slopes: flashlm attention has no ALiBi (pass None)")
    if return_attn_probs:
        raise L.FlashlmValueError("return_attn_probs: flashlm attention does not return probabilities (pass False)")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise L.FlashlmValueError(f"{name}: expected 4 dimensions [batch, seq, heads, head_dim], got shape "
                                      f"{tuple(t.shape)}")
    return _attention_bshd(q, k, v, bool(causal), True, softmax_scale, bool(deterministic), "flash")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's signature: [batch, heads, seq, head_dim] tensors,
    is_causal top-left aligned (query i sees keys j <= i). attn_mask and dropout are refused; heads_q !=
    heads_k needs enable_gqa=True, as in SDPA."""
    if attn_mask is not None:
        raise L.FlashlmValueError("attn_mask: flashlm attention takes no mask tensor (pass None; is_causal=True for "
                                  "a causal mask)")
    _no_dropout(dropout_p)
    qb, kb, vb = _bshd(query, "bhsd", "query"), _bshd(key, "bhsd", "key"), _bshd(value, "bhsd", "value")
    if not enable_gqa and (qb.shape[2] != kb.shape[2] or qb.shape[2] != vb.shape[2]):
        raise L.FlashlmValueError(f"enable_gqa: query has {qb.shape[2]} heads and key/value {kb.shape[2]}/"
                                  f"{vb.shape[2]}; pass enable_gqa=True for grouped-query attention")
    return _attention_bshd(qb, kb, vb, bool(is_causal), False, scale, False, "flash").transpose(1, 2)


def attention_forward(q, k, v, *, layout, causal=False, scale=None, causal_align=None, impl="flash"):
    """Forward only, no autograd: returns (o, lse) with o in q's layout and lse [batch, heads_q, seq_q]."""
    qb, kb, vb = _bshd(q, layout, "q"), _bshd(k, layout, "k"), _bshd(v, layout, "v")
    o, lse = _forward(qb, kb, vb, bool(causal), _bottom_right(causal, causal_align, qb.shape[1], kb.shape[1]), scale,
                      False, impl)
    return (o if layout == "bshd" else o.transpose(1, 2)), lse


def attention_backward(q, k, v, o, lse, dout, *, layout, causal=False, scale=None, causal_align=None,
                       deterministic=False, impl="flash"):
    """Backward only, no autograd: returns (dq, dk, dv) in the inputs' layout."""
    views = [_bshd(t, layout, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout"))]
    qb, kb, vb, ob, db = views
    grads = _backward(db, qb, kb, vb, ob, lse, bool(causal), _bottom_right(causal, causal_align, qb.shape[1],
                                                                           kb.shape[1]), scale, bool(deterministic),
                      impl)
    return grads if layout == "bshd" else tuple(g.transpose(1, 2) for g in grads)


class FlashAttention(torch.autograd.Function):
    """The CS336 interface: FlashAttention.apply(q, k, v, is_causal) on 3-D (batch, seq, head_dim) tensors,
    one head. Saves q, k, v, o and the logsumexp shaped (batch, seq_q) for the backward, nothing larger."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise L.FlashlmValueError(f"{name}: expected 3 dimensions (batch, seq, head_dim), got {tuple(t.shape)}")
        o, lse = _forward(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), bool(is_causal), False, None, False, "flash")
        ctx.save_for_backward(q, k, v, o.squeeze(2), lse.squeeze(1))  # lse (batch, seq_q)
        ctx.is_causal = bool(is_causal)
        return o.squeeze(2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.unsqueeze(2), q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), o.unsqueeze(2),
                               lse.unsqueeze(1), ctx.is_causal, False, None, False, "flash")
        return (*_once_differentiable((dq.squeeze(2), dk.squeeze(2), dv.squeeze(2)), (q, k, v, dout)), None)
