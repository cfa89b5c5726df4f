"""flash-attn's window_size and softcap through flashlm.flash_attn_func, flash_attn_varlen_func and
flashlm.attention against a float64 PyTorch reference with the same features written in torch, forward and
backward, on the CPU; bad arguments; and (on a torch with torch.library.custom_op) the fake kernels and
opcheck with the variant arguments."""
import math

import pytest

torch = pytest.importorskip("torch")
import flashlm  # noqa: E402
from flashlm import torch_ops  # noqa: E402

needs_ops = pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="torch has no torch.library.custom_op")


def reference(q, k, v, causal, bottom_right, window, softcap, scale=None):
    """Attention on [B, N, H, D] tensors in their dtype, flash-attn's definitions: query i sees key j iff
    i + off - left <= j <= i + off + right (off = Nk - Nq bottom-right, else 0; -1 unbounded; causal: right = 0),
    scores softcap * tanh(s / softcap); a row that sees no key gives 0."""
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
    s = s.masked_fill(~visible, float("-inf")).masked_fill(~has_key, 0.0)
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
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashlm.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))


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
