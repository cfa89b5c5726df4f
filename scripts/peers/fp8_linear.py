"""FP8 linear layers for the PyTorch peer of `flashlm bench --precision fp8` (lm_peers.py --modes fp8,
fp8-compile): tensorwise current scaling as torchao's "tensorwise" float8 recipe and flashlm's
src/model/fp8.h -- each operand scaled by fp8_max / max(amax, 1e-12) of the tensor now, rounded to FP8
(e4m3 weights and activations; e5m2 or e4m3 output gradients), multiplied by torch._scaled_mm with the
dequantisation scales, fp32 accumulation, bf16 out (the weight gradient in fp32). As flashlm does, the
backward casts x and w again from the bf16 tensors it saved rather than keeping FP8 copies, and the LM head
stays bf16. torch._scaled_mm wants its first operand row-major and its second column-major (both K-major),
so the backward's operands are cast from transposed copies.
"""
import torch
import torch.nn as nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantise(t, dtype):
    """(t · scale rounded to dtype, 1 / scale) with scale = fp8_max / max(amax, 1e-12), on the device."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, grad_dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        wb = w.to(torch.bfloat16)
        xq, xs = quantise(x2, E4M3)
        wq, ws = quantise(wb, E4M3)
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        ctx.save_for_backward(x2, wb)
        ctx.grad_dtype, ctx.shape = grad_dtype, shape
        return y.reshape(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wb = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        g = ctx.grad_dtype
        dyq, dys = quantise(dy2, g)                           # [n, out], row-major
        wtq, wts = quantise(wb.t().contiguous(), E4M3)        # wᵀ [in, out]
        dx = torch._scaled_mm(dyq, wtq.t(), scale_a=dys, scale_b=wts, out_dtype=torch.bfloat16)
        dytq, dyts = quantise(dy2.t().contiguous(), g)        # dyᵀ [out, n]
        xtq, xts = quantise(x2.t().contiguous(), E4M3)        # xᵀ [in, n]
        dw = torch._scaled_mm(dytq, xtq.t(), scale_a=dyts, scale_b=xts, out_dtype=torch.float32)
        return dx.reshape(ctx.shape), dw, None


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose three GEMMs run in FP8; the fp32 weight is the master."""

    grad_dtype = E5M2

    def forward(self, x):
        return _Fp8Matmul.apply(x, self.weight, self.grad_dtype)


def convert_blocks(model, grad_format="e5m2"):
    """Every nn.Linear inside model.blocks (q/k/v, output projection, w1/w2/w3) becomes an Fp8Linear sharing
    its weight; the LM head is left alone."""
    grad_dtype = E5M2 if grad_format == "e5m2" else E4M3
    for block in model.blocks:
        for name, child in list(block.named_children()):
            if type(child) is nn.Linear:
                fp8 = Fp8Linear(child.in_features, child.out_features, bias=False, device=child.weight.device)
                fp8.weight = child.weight
                fp8.grad_dtype = grad_dtype
                setattr(block, name, fp8)
    return model
