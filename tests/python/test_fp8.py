"""FP8 attention from PyTorch: torch.float8_e4m3fn q, k, v with q/k/v_descale in flashlm.attention. On the
CPU and on an sm_90 GPU the forward against float64 attention of the dequantised inputs; the backward
(torch.ops.flashlm.attention_fp8_bwd, on the CPU and any GPU) against float64 autograd of the same; autograd
through flashlm.attention; the fake kernels give the outputs' shapes and dtypes; opcheck."""
import math

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip(f"torch {torch.__version__} has no float8_e4m3fn", allow_module_level=True)
import flashlm  # noqa: E402
from flashlm import torch_ops  # noqa: E402


def fp8(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(torch.float8_e4m3fn).to(device)


def dequantised_reference(q, k, v, descales):
    """float64 attention of the dequantised inputs (value = stored * descale), BSHD, causal bottom-right, GQA."""
    qd, kd, vd = (t.double().cpu() * s for t, s in zip((q, k, v), descales))
    group = q.shape[2] // k.shape[2]
    kd, vd = kd.repeat_interleave(group, dim=2), vd.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / math.sqrt(q.shape[-1])
    nq, nk = q.shape[1], k.shape[1]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    return torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~mask, -math.inf).softmax(-1), vd)


def test_cpu_fp8_forward_matches_float64_of_the_dequantised_inputs():
    # Any head dim on the CPU (40 has no GPU kernel).
    q, k, v = fp8((2, 33, 4, 40), 1), fp8((2, 50, 2, 40), 2), fp8((2, 50, 2, 40), 3)
    o = flashlm.attention(q, k, v, layout="bshd", causal=True, causal_align="bottom_right", q_descale=0.5,
                          k_descale=0.25, v_descale=2.0)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    ref = dequantised_reference(q, k, v, (0.5, 0.25, 2.0))
    # fp32 arithmetic on the dequantised values, then one bf16 rounding (2^-9 relative): 2^-8 of each element
    # and 1e-4 of the scale for the fp32 sums.
    bound = 2.0**-8 * ref.abs() + 1e-4 * max(1.0, ref.abs().max().item())
    assert ((o.double() - ref).abs() <= bound).all()


def test_descales_need_fp8_inputs():
    q = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs only"):
        flashlm.attention(q, q, q, layout="bshd", v_descale=2.0)


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
def test_fake_kernel_gives_the_bf16_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 4, 33, 128, dtype=torch.float8_e4m3fn)
        k = torch.empty(2, 2, 40, 128, dtype=torch.float8_e4m3fn)
        o, lse = torch.ops.flashlm.attention_fp8_fwd(q, k, k, "bhsd", True, True, None, 0.5, 0.25, 2.0)
        assert o.shape == q.shape and o.dtype == torch.bfloat16
        assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32


def _sm90():
    return (torch.cuda.is_available() and flashlm.cuda_device_count() > 0
            and torch.cuda.get_device_capability() == (9, 0))


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_forward_matches_float64_of_the_dequantised_inputs(d):
    q, k, v = fp8((2, 100, 4, d), 1, "cuda"), fp8((2, 150, 2, d), 2, "cuda"), fp8((2, 150, 2, d), 3, "cuda")
    o = flashlm.attention(q, k, v, layout="bshd", causal=True, causal_align="bottom_right", q_descale=0.5,
                          k_descale=0.25, v_descale=2.0)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    ref = dequantised_reference(q, k, v, (0.5, 0.25, 2.0))
    # P in e4m3 (2^-4 relative per element) dominates; a loose bound here, the C++ test holds the derived one.
    assert (o.double().cpu() - ref).abs().max().item() <= 0.1 * max(1.0, ref.abs().max().item())


def dequantised_gradients(q, k, v, descales, dout):
    """float64 gradients of the dequantised q, k, v for the loss sum(o * dout) (BSHD, causal bottom-right, GQA)."""
    qd, kd, vd = (t.double().cpu().mul(s).requires_grad_() for t, s in zip((q, k, v), descales))
    o = dequantised_reference(qd, kd, vd, (1.0, 1.0, 1.0))
    return torch.autograd.grad((o * dout.double().cpu()).sum(), (qd, kd, vd))


DESCALES = (0.037, 0.026, 2.5)  # none a power of two; q and k small (amax/448-like), v above 1


def fp8_problem(shape_q, shape_k, device):
    """q, k, v float8_e4m3fn of stddev 24, 40 and 4 (dequantised scores of order 1), dout bfloat16."""
    q = (torch.randn(shape_q, generator=torch.Generator().manual_seed(11)) * 24).to(torch.float8_e4m3fn)
    k = (torch.randn(shape_k, generator=torch.Generator().manual_seed(12)) * 40).to(torch.float8_e4m3fn)
    v = (torch.randn(shape_k, generator=torch.Generator().manual_seed(13)) * 4).to(torch.float8_e4m3fn)
    dout = torch.randn(shape_q, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    return q.to(device), k.to(device), v.to(device), dout.to(device)


def check_fp8_backward(device, d, grad_dtype):
    q, k, v, dout = fp8_problem((2, 33, 4, d), (2, 50, 2, d), device)
    # o and lse of the CPU forward (every device's backward takes them: the GPU's forward needs an sm_90 GPU)
    o, lse = torch.ops.flashlm.attention_fp8_fwd(q.cpu(), k.cpu(), v.cpu(), "bshd", True, True, None, *DESCALES)
    dq, dk, dv = torch.ops.flashlm.attention_fp8_bwd(dout, q, k, v, o.to(device), lse.to(device), "bshd", True,
                                                     True, None, *DESCALES, False, grad_dtype)
    want = dequantised_gradients(q, k, v, DESCALES, dout)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert got.dtype == grad_dtype and got.shape == ref.shape and got.device.type == device, name
        # bf16 o in Delta and the bf16 or fp32 gradients: well inside 2^-5 of the gradients' scale; a descale
        # missing or applied twice (factors 0.026 to 2.5) is far outside.
        err = (got.double().cpu() - ref).abs().max().item()
        assert err <= 2.0**-5 * max(1.0, ref.abs().max().item()), (name, err, ref.abs().max().item())


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_cpu_fp8_backward_gives_the_gradients_of_the_dequantised_inputs(grad_dtype):
    check_fp8_backward("cpu", 40, grad_dtype)


def _gpu():
    return torch.cuda.is_available() and flashlm.cuda_device_count() > 0


@pytest.mark.skipif(not (torch_ops.HAS_CUSTOM_OPS and _gpu()), reason="needs a GPU and torch.library.custom_op")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_cuda_fp8_backward_gives_the_gradients_of_the_dequantised_inputs(d, grad_dtype):
    check_fp8_backward("cuda", d, grad_dtype)


def assert_stored_gradient(t, stored, name):
    """Autograd's gradient of the e4m3 input t, the gradient of the stored values (descale times the dequantised
    one), which autograd stores in the input's dtype (e4m3: 2^-4 relative, 2^-10 absolute below its normals),
    against float64 `stored`."""
    assert t.grad.dtype == torch.float8_e4m3fn, name
    err = (t.grad.double().cpu() - stored.cpu()).abs()
    assert (err <= 2.0**-3 * stored.abs().cpu() + 2.0**-5 * stored.abs().max().cpu() + 2.0**-9).all(), name


def check_fp8_autograd(device, d):
    q, k, v, dout = fp8_problem((2, 33, 4, d), (2, 50, 2, d), device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flashlm.attention(q, k, v, layout="bshd", causal=True, causal_align="bottom_right", q_descale=DESCALES[0],
                          k_descale=DESCALES[1], v_descale=DESCALES[2])
    assert o.grad_fn is not None
    (o.float() * dout.float()).sum().backward()
    want = dequantised_gradients(q.detach(), k.detach(), v.detach(), DESCALES, dout)
    for name, t, ref, s in zip(("q", "k", "v"), (q, k, v), want, DESCALES):
        assert_stored_gradient(t, ref * s, name)


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
def test_cpu_fp8_attention_is_differentiable():
    check_fp8_autograd("cpu", 40)


@pytest.mark.skipif(not (torch_ops.HAS_CUSTOM_OPS and _sm90()), reason="needs an sm_90 GPU (the FP8 forward)")
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_fp8_attention_is_differentiable(d):
    # The GPU forward rounds P to e4m3 (2^-4 relative), which reaches the gradients through o and Delta, so the
    # float64 gradients of the exact attention are no tight reference here (test_attention_fp8 bounds each pass
    # on its own): autograd's gradients against descale times attention_fp8_bwd's on the very o and lse, within
    # the e4m3 rounding autograd applies (and the dQ atomics' order).
    q, k, v, dout = fp8_problem((2, 33, 4, d), (2, 50, 2, d), "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = torch.ops.flashlm.attention_fp8_fwd(q, k, v, "bshd", True, True, None, *DESCALES)
    (o.float() * dout.float()).sum().backward()
    want = torch.ops.flashlm.attention_fp8_bwd(dout, q.detach(), k.detach(), v.detach(), o.detach(), lse, "bshd",
                                               True, True, None, *DESCALES, False, torch.float32)
    for name, t, g, s in zip(("q", "k", "v"), (q, k, v), want, DESCALES):
        assert_stored_gradient(t, (g * s).double(), name)


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
def test_fp8_backward_fake_kernel_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 4, 33, 64, dtype=torch.float8_e4m3fn)
        k = torch.empty(2, 2, 40, 64, dtype=torch.float8_e4m3fn)
        o = torch.empty(2, 4, 33, 64, dtype=torch.bfloat16)
        lse = torch.empty(2, 4, 33, dtype=torch.float32)
        for grad_dtype in (torch.bfloat16, torch.float32):
            dq, dk, dv = torch.ops.flashlm.attention_fp8_bwd(o, q, k, k, o, lse, "bhsd", True, True, None, *DESCALES,
                                                             False, grad_dtype)
            assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
            assert dq.dtype == dk.dtype == dv.dtype == grad_dtype
    q, k, v, dout = fp8_problem((1, 17, 2, 32), (1, 20, 1, 32), "cpu")
    o, lse = torch.ops.flashlm.attention_fp8_fwd(q, k, v, "bshd", False, False, None, *DESCALES)
    # Not test_schema: its harness multiplies the inputs, which torch does not implement for float8_e4m3fn.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.flashlm.attention_fp8_bwd,
                          (dout, q, k, v, o, lse, "bshd", False, False, None, *DESCALES, False, torch.float32),
                          test_utils=utils)
    # With inputs that require grad, test_aot_dispatch_dynamic runs the autograd formula (compiled and eager).
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashlm.attention_fp8_fwd, (q, k, v, "bshd", False, False, None, *DESCALES),
                          test_utils=utils)


def test_fp8_backward_bad_gradient_dtype_is_a_clear_error():
    q, k, v, dout = fp8_problem((1, 17, 2, 32), (1, 20, 1, 32), "cpu")
    o, lse = torch_ops._forward(q, k, v, "bshd", False, False, None, False, "flash", descales=DESCALES)
    with pytest.raises(ValueError, match="dq: expected dtype bf16 or fp32 for the gradients of fp8_e4m3 inputs"):
        torch_ops._backward(dout, q, k, v, o, lse, "bshd", False, False, None, False, "flash", descales=DESCALES,
                            grad_dtype=torch.float16)


# ---- Per-head descales (FlashAttention-3's granularity): float32 [batch, heads_k] tensors. ----

def per_head_descales(batch, heads_k):
    """DESCALES times 1 + 0.37 b + 0.23 hk: distinct per (batch, key head), none a power of two."""
    f = 1 + 0.37 * torch.arange(batch)[:, None] + 0.23 * torch.arange(heads_k)[None, :]
    return tuple((s * f).float() for s in DESCALES)


def broadcast(d, heads):
    """A [batch, heads_k] descale as the [batch, 1, heads, 1] factor of a BSHD tensor with `heads` heads."""
    return d.double().repeat_interleave(heads // d.shape[1], dim=1)[:, None, :, None]


def check_per_head_descales(device, d):
    """flashlm.attention, attention_fp8_heads_fwd/_bwd and autograd with per-head descales (on `device`, as the
    inputs) against float64 of the inputs dequantised head by head. The CUDA forward needs an sm_90 GPU: on another
    the CUDA backward is given the CPU forward's o and lse (with per-head descales it recomputes its own)."""
    q, k, v, dout = fp8_problem((2, 33, 4, d), (2, 50, 2, d), device)
    host = per_head_descales(2, 2)
    qd, kd, vd = (t.to(device) for t in host)
    factors = tuple(broadcast(t, heads) for t, heads in zip(host, (4, 2, 2)))
    forward = device == "cpu" or _sm90()
    if forward:
        o = flashlm.attention(q, k, v, layout="bshd", causal=True, causal_align="bottom_right", q_descale=qd,
                              k_descale=kd, v_descale=vd)
        ref = dequantised_reference(q, k, v, factors)
        scale = max(1.0, ref.abs().max().item())
        if device == "cpu":  # fp32 arithmetic, one bf16 rounding
            assert ((o.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-4 * scale).all()
        else:  # P in e4m3 (2^-4 relative per element); the C++ tests hold the derived bound
            assert (o.double().cpu() - ref).abs().max().item() <= 0.1 * scale
        o, lse = torch.ops.flashlm.attention_fp8_heads_fwd(q, k, v, "bshd", True, True, None, qd, kd, vd)
    else:
        o, lse = torch.ops.flashlm.attention_fp8_heads_fwd(q.cpu(), k.cpu(), v.cpu(), "bshd", True, True, None, *host)
        o, lse = o.to(device), lse.to(device)
    grads = torch.ops.flashlm.attention_fp8_heads_bwd(dout, q, k, v, o, lse, "bshd", True, True, None, qd, kd, vd,
                                                      False, torch.float32)
    want = dequantised_gradients(q, k, v, factors, dout)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        # CUDA: bf16 copies of the dequantised inputs (2^-9) and bf16 P and dS; a descale of another head (factors
        # 1.23 to 1.6 apart) or missing is far outside.
        assert got.device.type == device, name
        err = (got.double().cpu() - ref).abs().max().item()
        assert err <= 2.0**-5 * max(1.0, ref.abs().max().item()), (name, err)
    if not forward:
        return

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = flashlm.attention(q, k, v, layout="bshd", causal=True, causal_align="bottom_right", q_descale=qd,
                          k_descale=kd, v_descale=vd)
    (o.float() * dout.float()).sum().backward()
    for name, t, ref, f in zip(("q", "k", "v"), (q, k, v), want, factors):
        assert_stored_gradient(t, ref * f, name)  # each head's gradient times its own descale


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
def test_cpu_per_head_descales_forward_backward_and_autograd():
    check_per_head_descales("cpu", 40)


@pytest.mark.skipif(not (torch_ops.HAS_CUSTOM_OPS and _gpu()), reason="needs a GPU and torch.library.custom_op")
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_per_head_descales_forward_backward_and_autograd(d):
    check_per_head_descales("cuda", d)


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
def test_uniform_per_head_descales_are_the_per_tensor_ones_and_mix_with_floats():
    q, k, v, dout = fp8_problem((1, 17, 2, 32), (1, 20, 1, 32), "cpu")
    full = tuple(torch.full((1, 1), s, dtype=torch.float32) for s in DESCALES)
    o, lse = torch.ops.flashlm.attention_fp8_fwd(q, k, v, "bshd", False, False, None, *DESCALES)
    oh, lseh = torch.ops.flashlm.attention_fp8_heads_fwd(q, k, v, "bshd", False, False, None, *full)
    assert torch.equal(o, oh) and torch.equal(lse, lseh)
    g = torch.ops.flashlm.attention_fp8_bwd(dout, q, k, v, o, lse, "bshd", False, False, None, *DESCALES, False,
                                            torch.float32)
    gh = torch.ops.flashlm.attention_fp8_heads_bwd(dout, q, k, v, o, lse, "bshd", False, False, None, *full, False,
                                                   torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(g, gh))
    # A tensor beside floats: the floats become uniform per-head descales.
    mixed = flashlm.attention(q, k, v, layout="bshd", q_descale=full[0], k_descale=DESCALES[1], v_descale=DESCALES[2])
    assert torch.equal(mixed, o)


@pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="no torch.library.custom_op")
def test_per_head_descales_opcheck_and_bad_shape():
    q, k, v, dout = fp8_problem((1, 17, 2, 32), (1, 20, 1, 32), "cpu")
    qd, kd, vd = per_head_descales(1, 1)
    o, lse = torch.ops.flashlm.attention_fp8_heads_fwd(q, k, v, "bshd", False, False, None, qd, kd, vd)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.flashlm.attention_fp8_heads_bwd,
                          (dout, q, k, v, o, lse, "bshd", False, False, None, qd, kd, vd, False, torch.float32),
                          test_utils=utils)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashlm.attention_fp8_heads_fwd, (qg, kg, vg, "bshd", False, False, None, qd, kd, vd),
                          test_utils=utils)
    with pytest.raises(ValueError, match="k_descale_heads.*expected shape \\[1, 1\\]"):
        flashlm.attention(q, k, v, layout="bshd", k_descale=torch.ones(1, 2))
