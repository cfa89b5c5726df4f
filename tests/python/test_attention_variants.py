"""flash-attn's window_size, softcap, alibi_slopes, learnable_sink (attention sinks) and a head dim of v's own
through flashlm.flash_attn_func, flash_attn_varlen_func and flashlm.attention against a float64 PyTorch reference
with the same features written in torch, forward and backward (the sink's gradient through autograd), on the CPU;
bad arguments; and (on a torch with torch.library.custom_op) the fake kernels, opcheck and
torch.compile(fullgraph=True) with the variant arguments."""
import math

import pytest

torch = pytest.importorskip("torch")
import flashlm  # noqa: E402
from flashlm import torch_ops  # noqa: E402

needs_ops = pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="torch has no torch.library.custom_op")


def reference(q, k, v, causal, bottom_right, window, softcap, scale=None, alibi_slopes=None, sink=None):
    """Attention on [B, N, H, D] tensors in their dtype, flash-attn's definitions: query i sees key j iff
    i + off - left <= j <= i + off + right (off = Nk - Nq bottom-right, else 0; -1 unbounded; causal: right = 0),
    scores softcap * tanh(s / softcap) - slope * |i + off - j|, the sink (per head) a column of the softmax with no
    value; a row that sees no key gives 0. v may have its own head dim."""
    b, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(hq // hk, dim=1), vh.repeat_interleave(hq // hk, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(d))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0
    off = nk - nq if bottom_right else 0
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i + off - left
    if right >= 0:
        visible &= j <= i + off + right
    has_key = visible.any(-1, keepdim=True)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).reshape(-1, hq)[:, :, None, None]  # [1 or B, H, 1, 1]
        s = s - slopes * (i + off - j).abs().to(s.dtype)
    s = s.masked_fill(~visible, float("-inf"))
    if sink is not None:
        col = sink.to(s.dtype)[None, :, None, None].expand(b, hq, nq, 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :nk]
        p = torch.where(visible, p, torch.zeros((), dtype=p.dtype))
        return (p @ vh).transpose(1, 2)
    s = s.masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    return (p @ vh).transpose(1, 2)


def rand(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)


def check(got, want, grads, want_grads, dtype, got64=None):
    tol = 3e-5 if dtype == torch.float32 else 1e-10
    scale = max(1.0, want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= tol * scale
    for name, g, w in zip("qkv", grads, want_grads):
        assert not torch.isnan(g).any(), name
        assert (g.double() - w).abs().max().item() <= tol * max(1.0, w.abs().max().item()), name


# (seq_q, seq_k, heads_q, heads_k, causal, window, softcap)
CASES = [
    (17, 17, 4, 2, False, (3, -1), 0.0),
    (17, 40, 2, 2, True, (5, 0), 0.0),
    (1, 77, 4, 1, True, (10, -1), 0.0),
    (127, 64, 2, 1, False, (-1, 4), 0.5),
    (40, 16, 2, 2, False, (0, 0), 0.0),
    (33, 20, 2, 1, False, (2, 1), 30.0),       # bottom-right, more queries than keys: early rows see no key
    (30, 30, 2, 2, False, (-1, -1), 0.05),     # softcap tiny
    (30, 30, 2, 2, True, (1000, 1000), 2.0),   # a window past the sequence
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}_k{}_h{}x{}_causal{}_w{}_{}_cap{}".format(
    c[0], c[1], c[2], c[3], int(c[4]), c[5][0], c[5][1], c[6]))
def test_flash_attn_func_matches_the_torch_reference(case, dtype):
    nq, nk, hq, hk, causal, window, softcap = case
    q, k, v = rand((2, nq, hq, 16), 1, dtype), rand((2, nk, hk, 16), 2, dtype), rand((2, nk, hk, 16), 3, dtype)
    o = flashlm.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = reference(q64, k64, v64, causal, True, window, softcap)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    check(o, want, grads, want_grads, dtype)


def test_attention_bhsd_top_left_window_and_softcap():
    q, k, v = rand((1, 2, 20, 8), 5), rand((1, 2, 25, 8), 6), rand((1, 2, 25, 8), 7)
    o = flashlm.attention(q, k, v, layout="bhsd", causal=False, causal_align="top_left", window_size=(2, 3),
                          softcap=1.5, scale=0.7)
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    want = reference(q64, k64, v64, False, False, (2, 3), 1.5, scale=0.7).transpose(1, 2)
    want_grads = [g.transpose(1, 2) for g in torch.autograd.grad(want, (q64, k64, v64), dout.double())]
    check(o, want, grads, want_grads, torch.float32)


def test_varlen_window_and_softcap_per_sequence():
    len_q, len_k = [5, 17, 1, 30], [9, 17, 40, 12]
    cu_q = torch.tensor([0, 5, 22, 23, 53], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 26, 66, 78], dtype=torch.int32)
    q, k, v = rand((53, 4, 16), 8), rand((78, 2, 16), 9), rand((78, 2, 16), 10)
    o = flashlm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 40, causal=True, window_size=(4, 0), softcap=3.0)
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    outs, qi, ki = [], 0, 0
    for lq, lk in zip(len_q, len_k):
        outs.append(reference(q64[None, qi:qi + lq], k64[None, ki:ki + lk], v64[None, ki:ki + lk], True, True,
                              (4, 0), 3.0)[0])
        qi, ki = qi + lq, ki + lk
    want = torch.cat(outs)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    check(o, want, grads, want_grads, torch.float32)


def test_bad_window_and_softcap_raise_value_errors_naming_them():
    q = rand((1, 6, 2, 8), 1)
    with pytest.raises(ValueError, match="window_size: expected a pair of ints"):
        flashlm.flash_attn_func(q, q, q, window_size=(4,))
    with pytest.raises(ValueError, match="window_size: expected a pair of ints"):
        flashlm.flash_attn_func(q, q, q, window_size=(1.5, 0))
    with pytest.raises(ValueError, match="window_size_left: expected -1 \\(unbounded\\)"):
        flashlm.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size_right"):
        flashlm.flash_attn_func(q, q, q, window_size=(3, -5))
    for cap in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap: expected a finite number >= 0"):
            flashlm.flash_attn_func(q, q, q, softcap=cap)
    with pytest.raises(ValueError, match="softcap: expected a float"):
        flashlm.flash_attn_func(q, q, q, softcap="big")


@pytest.mark.skipif(not (torch.cuda.is_available() and flashlm.cuda_device_count() > 0), reason="no GPU")
def test_cuda_fp32_tensors_with_a_window_or_softcap_raise_the_library_error():
    # The 16-bit flash kernels have both variants; the fp32 CUDA kernels refuse them by name.
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float32)
    with pytest.raises(ValueError, match="window_size_left/window_size_right: the fp32 attention kernels"):
        flashlm.flash_attn_func(q, q, q, window_size=(4, 0))
    with pytest.raises(ValueError, match="softcap: the fp32 attention kernels have no soft-capping"):
        flashlm.flash_attn_func(q, q, q, softcap=30.0)


@needs_ops
def test_operators_take_the_variant_in_fake_mode_and_pass_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = rand((1, 9, 2, 8), 1), rand((1, 12, 1, 8), 2), rand((1, 12, 1, 8), 3)
    args = ("bshd", True, True, None, False, "flash", 3, 0, 2.0)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        o, lse = torch.ops.flashlm.attention_fwd(fq, fk, fv, *args)
        assert o.shape == q.shape and lse.shape == (1, 2, 9)
    torch.library.opcheck(torch.ops.flashlm.attention_fwd, (q, k, v, *args))
    o, lse = torch.ops.flashlm.attention_fwd(q, k, v, *args)
    dout = torch.randn_like(o)
    torch.library.opcheck(torch.ops.flashlm.attention_bwd, (dout, q.detach(), k.detach(), v.detach(), o.detach(),
                                                            lse, *args))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cuk = torch.tensor([0, 5, 12], dtype=torch.int32)
    qv, kv, vv = (t.detach()[0].requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashlm.attention_varlen_fwd,
                          (qv, kv, vv, cu, cuk, 5, 7, True, True, None, False, "flash", 2, 0, 1.0))


def sinks(h, seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(h, generator=g, dtype=torch.float64) * 1.5).float().requires_grad_(requires_grad)


def slopes(shape):
    h = shape[-1]
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
    if len(shape) == 2:
        base = base[None, :] * (1 + 0.5 * torch.arange(shape[0], dtype=torch.float64))[:, None]
    return base.float()


# (seq_q, seq_k, heads_q, heads_k, d, d_v, causal, window, softcap, alibi shape or None, with a sink)
EXTRA_CASES = [
    (17, 17, 4, 2, 16, 16, False, (-1, -1), 0.0, (4,), False),
    (17, 40, 2, 2, 16, 16, True, (-1, -1), 0.0, (2, 2), False),
    (33, 20, 4, 1, 16, 16, True, (-1, -1), 0.0, None, True),     # causal bottom-right, Nq > Nk: rows with no key
    (20, 20, 2, 2, 16, 8, False, (3, 1), 2.0, (2,), True),
    (9, 30, 4, 2, 24, 32, False, (-1, -1), 0.0, None, False),    # d_v > d_qk
    (30, 12, 2, 1, 48, 16, True, (4, 0), 0.0, (2, 2), True),
    (25, 25, 2, 2, 192 // 4, 128 // 4, True, (-1, -1), 30.0, (2,), True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", EXTRA_CASES, ids=lambda c: "q{}_k{}_h{}x{}_d{}_{}_causal{}_w{}_{}_cap{}_alibi{}_sink{}".format(
    c[0], c[1], c[2], c[3], c[4], c[5], int(c[6]), c[7][0], c[7][1], c[8], "x".join(map(str, c[9] or ())), int(c[10])))
def test_alibi_sinks_and_head_dim_v_match_the_torch_reference(case, dtype):
    nq, nk, hq, hk, d, dv, causal, window, softcap, alibi, with_sink = case
    q, k, v = rand((2, nq, hq, d), 11, dtype), rand((2, nk, hk, d), 12, dtype), rand((2, nk, hk, dv), 13, dtype)
    a = slopes(alibi) if alibi else None
    sink = sinks(hq, 14) if with_sink else None
    o = flashlm.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=a,
                                learnable_sink=sink)
    assert o.shape == (2, nq, hq, dv)
    dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(15), dtype=torch.float64).to(dtype)
    inputs = (q, k, v) + ((sink,) if with_sink else ())
    grads = torch.autograd.grad(o, inputs, dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s64 = sink.detach().double().requires_grad_(True) if with_sink else None
    want = reference(q64, k64, v64, causal, True, window, softcap, alibi_slopes=a, sink=s64)
    want_grads = torch.autograd.grad(want, (q64, k64, v64) + ((s64,) if with_sink else ()), dout.double())
    check(o, want, grads[:3], want_grads[:3], dtype)
    if with_sink:
        tol = 1e-4 if dtype == torch.float32 else 1e-5  # the sink is float32, its gradient float32 too
        assert grads[3].dtype == torch.float32 and grads[3].shape == (hq,)
        assert (grads[3].double() - want_grads[3]).abs().max().item() <= tol * max(1.0, want_grads[3].abs().max().item())


def test_sink_gradient_against_finite_differences():
    q, k, v = (rand((1, 7, 2, 8), s, torch.float64).detach() for s in (21, 22, 23))
    sink = sinks(2, 24)
    dout = torch.randn(1, 7, 2, 8, generator=torch.Generator().manual_seed(25), dtype=torch.float64)

    def loss(s):
        return (flashlm.flash_attn_func(q, k, v, causal=True, window_size=(2, 0), learnable_sink=s) * dout).sum()

    (dsink,) = torch.autograd.grad(loss(sink), sink)
    step = 2.0 ** -10
    for h in range(2):
        up, down = sink.detach().clone(), sink.detach().clone()
        up[h] += step
        down[h] -= step
        fd = (loss(up) - loss(down)).item() / (2 * step)
        assert abs(dsink[h].item() - fd) <= 1e-5 * max(1.0, abs(fd)), h


def test_gradcheck_float64_with_alibi_and_a_fixed_sink():
    q, k = rand((1, 6, 2, 8), 31, torch.float64), rand((1, 9, 2, 8), 32, torch.float64)
    v = rand((1, 9, 2, 4), 33, torch.float64)
    sink = sinks(2, 34, requires_grad=False)
    assert torch.autograd.gradcheck(
        lambda a, b_, c: flashlm.flash_attn_func(a, b_, c, causal=True, alibi_slopes=slopes((2,)),
                                                 learnable_sink=sink), (q, k, v))


def test_varlen_alibi_per_sequence_sinks_and_head_dim_v():
    len_q, len_k = [5, 17, 1, 30], [9, 17, 40, 12]
    cu_q = torch.tensor([0, 5, 22, 23, 53], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 26, 66, 78], dtype=torch.int32)
    q, k, v = rand((53, 4, 16), 8), rand((78, 2, 16), 9), rand((78, 2, 8), 10)
    a = slopes((4, 4))
    sink = sinks(4, 11)
    o = flashlm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 40, causal=True, window_size=(6, 0), alibi_slopes=a,
                                       learnable_sink=sink)
    assert o.shape == (53, 4, 8)
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sink), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s64 = sink.detach().double().requires_grad_(True)
    outs, qi, ki = [], 0, 0
    for n, (lq, lk) in enumerate(zip(len_q, len_k)):
        outs.append(reference(q64[None, qi:qi + lq], k64[None, ki:ki + lk], v64[None, ki:ki + lk], True, True,
                              (6, 0), 0.0, alibi_slopes=a[n], sink=s64)[0])
        qi, ki = qi + lq, ki + lk
    want = torch.cat(outs)
    want_grads = torch.autograd.grad(want, (q64, k64, v64, s64), dout.double())
    check(o, want, grads[:3], want_grads[:3], torch.float32)
    assert (grads[3].double() - want_grads[3]).abs().max().item() <= 1e-4 * max(1.0, want_grads[3].abs().max().item())


def test_bad_alibi_and_sinks_raise_value_errors_naming_them():
    q = rand((2, 6, 4, 8), 1)
    for bad in (torch.ones(3), torch.ones(3, 4), torch.ones(2, 4, 1)):
        with pytest.raises(ValueError, match="alibi_slopes: expected \\[heads_q\\] or \\[batch, heads_q\\]"):
            flashlm.flash_attn_func(q, q, q, alibi_slopes=bad)
    with pytest.raises(ValueError, match="alibi_slopes: expected dtype torch.float32"):
        flashlm.flash_attn_func(q, q, q, alibi_slopes=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="alibi_slopes: slope of batch 0 head 1 is nan"):
        flashlm.flash_attn_func(q, q, q, alibi_slopes=torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    with pytest.raises(ValueError, match="learnable_sink: expected shape \\[4\\]"):
        flashlm.flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learnable_sink: the sink of head 2 is"):
            flashlm.flash_attn_func(q, q, q, learnable_sink=torch.tensor([0.0, 1.0, bad, 0.0]))
    with pytest.raises(ValueError, match="learnable_sink: expected a float32 tensor"):
        flashlm.flash_attn_func(q, q, q, learnable_sink=[0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="v: expected k's batch, seq_k and heads_k"):
        flashlm.flash_attn_func(q, q, rand((2, 5, 4, 8), 2))
    # -inf is no sink: the same output as none.
    o = flashlm.flash_attn_func(q, q, q, learnable_sink=torch.full((4,), float("-inf")))
    assert torch.equal(o, flashlm.flash_attn_func(q, q, q))


@pytest.mark.skipif(not (torch.cuda.is_available() and flashlm.cuda_device_count() > 0), reason="no GPU")
def test_cuda_alibi_sinks_and_head_dim_v_run_in_16_bit_and_fp32_refuses_alibi_and_sinks():
    # The fp16/bf16 flash kernels (mma.sync) have ALiBi and sinks, and run a head_dim_v of its own (64 with 32) on
    # zero-padded copies: the CPU's fp32 answer on the same inputs, within bf16 rounding; the fp32 CUDA kernels
    # refuse ALiBi and sinks by name.
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    a, sink = slopes((2,)).cuda(), sinks(2, 5, requires_grad=False).cuda()
    o = flashlm.flash_attn_func(q, q, q, alibi_slopes=a, learnable_sink=sink)
    qc = q.cpu().float()
    ref = flashlm.flash_attn_func(qc, qc, qc, alibi_slopes=a.cpu(), learnable_sink=sink.cpu())
    assert (o.cpu().float() - ref).abs().max().item() < 3e-2
    q32 = q.float()
    with pytest.raises(ValueError, match="alibi_slopes: the fp32 attention kernels have no ALiBi"):
        flashlm.flash_attn_func(q32, q32, q32, alibi_slopes=a)
    with pytest.raises(ValueError, match="learnable_sink: the fp32 attention kernels have no attention sinks"):
        flashlm.flash_attn_func(q32, q32, q32, learnable_sink=sink)
    v = q[..., :32].contiguous()
    o = flashlm.flash_attn_func(q, q, v)
    assert o.shape == (1, 16, 2, 32)
    ref = flashlm.flash_attn_func(qc, qc, v.cpu().float())
    assert (o.cpu().float() - ref).abs().max().item() < 3e-2


@pytest.mark.skipif(not (torch.cuda.is_available() and flashlm.cuda_device_count() > 0), reason="no GPU")
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_head_dims_192_and_128_match_the_fp64_reference_in_both_passes(deterministic):
    # DeepSeek's MLA shape on any GPU: the forward on the Hopper kernels' own pair on an sm_90 GPU, else on
    # mma.sync padded to 256, the backward on mma.sync padded to 256 everywhere. o takes v's head dim; o and the
    # gradients within the low-precision rule of the fp64 reference on the same rounded inputs (twice the error of
    # the same attention computed in fp32 and rounded to bf16, plus a few bf16 roundings of the scale: the kernels'
    # P and dS are bf16 too).
    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16)
               for shape in ((1, 100, 4, 192), (1, 130, 2, 192), (1, 130, 2, 128)))
    dout = torch.randn(1, 100, 4, 128, generator=gen).to(torch.bfloat16)
    qg, kg, vg = (t.cuda().requires_grad_() for t in (q, k, v))
    o = flashlm.flash_attn_func(qg, kg, vg, causal=True, deterministic=deterministic)
    assert o.shape == (1, 100, 4, 128)
    grads = torch.autograd.grad(o, (qg, kg, vg), dout.cuda())
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = reference(q64, k64, v64, True, True, (-1, -1), 0.0)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    lowp = reference(q32, k32, v32, True, True, (-1, -1), 0.0)
    lowp_grads = torch.autograd.grad(lowp, (q32, k32, v32), dout.float())
    for name, got, ref, low in zip(("o", "dq", "dk", "dv"), (o,) + grads, (want,) + want_grads,
                                   (lowp,) + lowp_grads):
        ref = ref.detach()
        low_err = (low.detach().to(torch.bfloat16).double() - ref).abs().max().item()
        tol = 2 * low_err + 1e-3 + 4 / 256 * max(1.0, ref.abs().max().item())
        err = (got.detach().cpu().double() - ref).abs().max().item()
        assert err <= tol, (name, err, tol)


@needs_ops
def test_operators_take_alibi_and_sinks_in_fake_mode_and_pass_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = rand((2, 9, 2, 8), 1), rand((2, 12, 1, 8), 2), rand((2, 12, 1, 4), 3)
    a, sink = slopes((2, 2)), sinks(2, 4)
    args = ("bshd", True, True, None, False, "flash", 3, 0, 2.0, a, sink)
    with FakeTensorMode() as mode:
        fq, fk, fv, fa, fs = (mode.from_tensor(t) for t in (q, k, v, a, sink))
        o, lse = torch.ops.flashlm.attention_fwd(fq, fk, fv, *args[:-2], fa, fs)
        assert o.shape == (2, 9, 2, 4) and lse.shape == (2, 2, 9)
    torch.library.opcheck(torch.ops.flashlm.attention_fwd, (q, k, v, *args))
    o, lse = torch.ops.flashlm.attention_fwd(q, k, v, *args)
    dout = torch.randn_like(o)
    torch.library.opcheck(torch.ops.flashlm.attention_bwd, (dout, q.detach(), k.detach(), v.detach(), o.detach(),
                                                            lse, *args[:-1], sink.detach()))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cuk = torch.tensor([0, 5, 12], dtype=torch.int32)
    qv, kv, vv = (t.detach()[0].requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashlm.attention_varlen_fwd,
                          (qv, kv, vv, cu, cuk, 5, 7, True, True, None, False, "flash", 2, 0, 1.0, a, sink))


@needs_ops
def test_compile_fullgraph_with_alibi_and_a_learnable_sink():
    torch._dynamo.reset()
    q, k, v = rand((2, 17, 4, 16), 41), rand((2, 20, 2, 16), 42), rand((2, 20, 2, 8), 43)
    a, sink = slopes((4,)), sinks(4, 44)

    def loss(q, k, v, sink):
        return flashlm.flash_attn_func(q, k, v, causal=True, alibi_slopes=a, learnable_sink=sink).sin().sum()

    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, sink)
    grads = torch.autograd.grad(got, (q, k, v, sink))
    want = loss(q, k, v, sink)
    want_grads = torch.autograd.grad(want, (q, k, v, sink))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(q, k, v, sink)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
