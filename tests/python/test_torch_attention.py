"""flashlm.attention / flashlm.FlashAttention against a float64 PyTorch reference, forward and backward,
on CPU (always) and CUDA (when a GPU is visible)."""
import math

import pytest

torch = pytest.importorskip("torch")
import flashlm  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashlm.cuda_device_count() > 0 else [])


def reference(q, k, v, causal, align, scale):
    """Naive attention on [B, N, H, D] tensors, in their dtype; fully masked rows give 0."""
    b, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh = kh.repeat_interleave(hq // hk, dim=1)
    vh = vh.repeat_interleave(hq // hk, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(d))
    if causal:
        offset = nk - nq if align == "bottom_right" else 0
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        visible = j <= i + offset
        has_key = visible.any(-1, keepdim=True)
        s = s.masked_fill(~visible, float("-inf")).masked_fill(~has_key, 0.0)
        p = torch.softmax(s, dim=-1) * has_key
    else:
        p = torch.softmax(s, dim=-1)
    return (p @ vh).transpose(1, 2)


def make(shape, dtype, device, layout, seed, sliced=False):
    """A [B, N, H, D] tensor of fresh random values, stored in `layout` (optionally a sliced view)."""
    g = torch.Generator().manual_seed(seed)
    b, n, h, d = shape
    if layout == "bhsd":
        base = torch.randn(b, h, n, d + (8 if sliced else 0), generator=g, dtype=torch.float64)
        t = base[..., :d]
    else:
        base = torch.randn(b, n, h, d + (8 if sliced else 0), generator=g, dtype=torch.float64)
        t = base[..., :d]
    return t.to(dtype=dtype, device=device).requires_grad_(True) if not sliced else \
        base.to(dtype=dtype, device=device)[..., :d].detach().requires_grad_(True)


def to_layout(t, layout):
    return t.transpose(1, 2) if layout == "bhsd" else t


def tolerance(dtype, ref_lowp_err, scale):
    if dtype == torch.float64:
        return 1e-10 * max(1.0, scale)
    if dtype == torch.float32:
        return 3e-5 * max(1.0, scale)
    return 2 * ref_lowp_err + 1e-3


# (batch, seq_q, seq_k, heads_q, heads_k, head_dim); head dim 80 runs a padded kernel on CUDA.
SHAPES = [(2, 17, 17, 2, 2, 32), (1, 1, 77, 4, 2, 64), (2, 127, 64, 4, 1, 16), (1, 65, 200, 2, 2, 128),
          (2, 40, 16, 2, 1, 64), (1, 33, 50, 2, 1, 80)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}x{}_d{}".format(*s))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("mask", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_float64_reference(device, shape, layout, mask, dtype):
    b, nq, nk, hq, hk, d = shape
    causal, align = mask != "none", ("bottom_right" if mask == "bottom_right" else "top_left")
    seed = nq * 31 + nk
    # Inputs in the storage layout under test (the bshd case also uses a sliced, non-contiguous view).
    q = make((b, nq, hq, d), dtype, device, layout, seed, sliced=(layout == "bshd"))
    k = make((b, nk, hk, d), dtype, device, layout, seed + 1)
    v = make((b, nk, hk, d), dtype, device, layout, seed + 2)
    qb, kb, vb = (to_layout(t, layout) for t in (q, k, v))  # [B, N, H, D] views

    o = flashlm.attention(q, k, v, causal=causal, causal_align=align, layout=layout)
    assert o.shape == q.shape and o.dtype == dtype and o.device == q.device
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64).to(dtype).to(device)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)

    # float64 oracle on the same (rounded) inputs, on the CPU.
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (qb, kb, vb))
    o64 = reference(q64, k64, v64, causal, align, None)
    g64 = torch.autograd.grad(o64, (q64, k64, v64), to_layout(do.double().cpu(), layout))
    # SPEC's low-precision rule measures against the naive attention computed in the same dtype.
    naive = [None] * 4
    if dtype != torch.float32:
        ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (qb, kb, vb))
        ol = reference(ql, kl, vl, causal, align, None)
        naive = [ol, *torch.autograd.grad(ol, (ql, kl, vl), to_layout(do, layout))]
    for i, (name, got, want) in enumerate((("o", to_layout(o, layout), o64), ("dq", to_layout(dq, layout), g64[0]),
                                           ("dk", to_layout(dk, layout), g64[1]),
                                           ("dv", to_layout(dv, layout), g64[2]))):
        err = (got.double().cpu() - want).abs().max().item()
        lowp = 0.0 if naive[i] is None else (naive[i].double().cpu() - want).abs().max().item()
        assert err <= tolerance(dtype, lowp, want.abs().max().item()), f"{name}: error {err}, naive {dtype} {lowp}"


@pytest.mark.parametrize("device", DEVICES)
def test_custom_scale_and_deterministic_backward(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (make((2, 50, 4, 64), dtype, device, "bshd", s) for s in (1, 2, 3))
    runs = []
    for _ in range(2):
        o = flashlm.attention(q, k, v, layout="bshd", causal=True, scale=0.3, deterministic=True)
        runs.append(torch.autograd.grad(o.sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    o64 = reference(*(t.detach().double().cpu() for t in (q, k, v)), True, "top_left", 0.3)
    assert (o.detach().double().cpu() - o64).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)


def test_gradcheck_float64_cpu():
    q, k, v = (make((1, 5, 2, 8), torch.float64, "cpu", "bshd", s) for s in (7, 8, 9))
    for causal, align in ((False, "top_left"), (True, "top_left"), (True, "bottom_right")):
        assert torch.autograd.gradcheck(
            lambda a, b_, c: flashlm.attention(a, b_, c, layout="bshd", causal=causal, causal_align=align), (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_cs336_flash_attention_apply(device, is_causal):
    dtype = torch.float32
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, 33, 64, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
               for _ in range(3))
    o = flashlm.FlashAttention.apply(q, k, v, is_causal)
    saved = o.grad_fn.saved_tensors
    assert any(t.shape == (4, 33) and t.dtype == torch.float32 for t in saved), "logsumexp (batch, seq) saved"
    assert max(t.numel() for t in saved) <= q.numel(), "nothing larger than the inputs is saved"
    o.backward(torch.ones_like(o))
    ref = reference(*(t.detach().double().cpu().unsqueeze(2).requires_grad_(True) for t in (q, k, v)),
                    is_causal, "top_left", None)
    assert (o.detach().double().cpu() - ref.squeeze(2)).abs().max().item() < 1e-4
    qq, kk, vv = (t.detach().double().cpu().unsqueeze(2).requires_grad_(True) for t in (q, k, v))
    r = reference(qq, kk, vv, is_causal, "top_left", None)
    r.backward(torch.ones_like(r))
    for got, want in ((q.grad, qq.grad), (k.grad, kk.grad), (v.grad, vv.grad)):
        assert (got.double().cpu() - want.squeeze(2)).abs().max().item() < 1e-4


def test_bad_arguments_raise_value_errors_with_the_library_message():
    q = torch.randn(1, 8, 3, 16)
    k = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="heads_q = 3 is not a multiple of k's heads_k = 2"):
        flashlm.attention(q, k, k, layout="bshd")
    with pytest.raises(ValueError, match="dtype torch.int32 is not supported"):
        flashlm.attention(q.int(), q.int(), q.int(), layout="bshd")
    with pytest.raises(ValueError, match="k: dtype fp64 differs from q's fp32"):
        flashlm.attention(q, q.double(), q, layout="bshd")
    with pytest.raises(ValueError, match="k: head_dim 8 differs"):
        flashlm.attention(q, q[..., :8], q[..., :8], layout="bshd")
    with pytest.raises(ValueError, match="expected 4 dimensions"):
        flashlm.attention(q[0], q[0], q[0], layout="bshd")
    with pytest.raises(ValueError, match="layout: 'sbhd'"):
        flashlm.attention(q, q, q, layout="sbhd")
    with pytest.raises(ValueError, match="the head_dim dimension must have stride 1"):
        t = torch.randn(1, 8, 3, 32)[..., ::2]
        flashlm.attention(t, t, t, layout="bshd")


def test_arrays_and_lists_are_a_type_error_asking_for_tensors():
    q = torch.randn(1, 8, 2, 16)
    calls = [lambda x: flashlm.attention(x, q, q, layout="bshd"),
             lambda x: flashlm.attention(q, q, x, layout="bhsd", causal=True),
             lambda x: flashlm.flash_attn_func(q, x, q),
             lambda x: flashlm.scaled_dot_product_attention(x, q, q),
             lambda x: flashlm.attention_forward(q, x, q, layout="bshd")]
    for call in calls:
        for bad in (q.numpy(), q.tolist()):
            with pytest.raises(TypeError, match="expected a torch.Tensor, got .*(ndarray|list)"):
                call(bad)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_device_mismatch_is_a_value_error():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k: on cpu but q is on cuda"):
        flashlm.attention(q, q.cpu(), q, layout="bshd")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_batch_zero_sum_backward_gives_empty_gradients(device, causal):
    """.sum().backward() on an empty batch hands a stride-0 gradient: it runs and gives empty gradients."""
    q, k, v = (torch.randn(0, 7, 2, 16, dtype=torch.float32, device=device, requires_grad=True) for _ in range(3))
    flashlm.attention(q, k, v, layout="bshd", causal=causal).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_is_refused_clearly(device):
    dtype = torch.float64 if device == "cpu" else torch.float32  # CUDA attention runs fp32, bf16, fp16 (and fp8)
    q, k, v = (torch.randn(1, 9, 2, 16, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    (dq,) = torch.autograd.grad(flashlm.attention(q, k, v, layout="bshd").square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        dq.sum().backward()
    q3, k3, v3 = (t[:, :, 0].detach().requires_grad_() for t in (q, k, v))
    (dq3,) = torch.autograd.grad(flashlm.FlashAttention.apply(q3, k3, v3, True).sum(), (q3,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        dq3.sum().backward()


def _fresh_pack(layout_struct, tensors, bhsd, options):
    """The bytes a call's arguments pack to from scratch: what a reused _lib.PackedCall must hold."""
    from flashlm import torch_ops
    fields = []
    for name, t in tensors:
        fields += torch_ops._describe_lse(t) if name == "lse" else torch_ops._describe(t, bhsd)
    return layout_struct.pack(*fields, *torch_ops._options(*options), 0, *torch_ops._NO_VARIANT,
                             *torch_ops._NO_EXTRA_POINTERS)


def _forget_pointers(calls):
    """Zeroes the first data pointer of every cached PackedCall, so that the next call's is the one holding
    its q (the allocator may hand an earlier variant's address again)."""
    for c in calls.values():
        c.words[0] = 0


def _packed_call_of(calls, q):
    """The PackedCall whose first tensor is q."""
    found = [c for c in calls.values() if c.words[0] == q.data_ptr()]
    assert len(found) == 1
    return found[0]


def test_reused_packed_arguments_equal_a_fresh_pack_when_geometry_or_options_change():
    # Consecutive calls that share a shape but differ in strides, layout, dtype or options: each one's
    # packed arguments (the cached buffer with its pointers rewritten) must be byte for byte what packing
    # them afresh gives, or the C side would see another call's strides or options.
    from flashlm import _lib
    base = torch.randn(2, 5, 3, 24, dtype=torch.float64)
    variants = [
        (lambda t: t[..., :16].contiguous(), "bshd", True, None),
        (lambda t: t[..., :16], "bshd", True, None),                 # the same shape, other strides
        (lambda t: t[..., :16].contiguous() if t[0, 0, 0, 0] != base[0, 0, 0, 0] else t[..., :16], "bshd", True,
         None),                                                      # q's strides alone differ from the first
        (lambda t: t[..., :16].transpose(1, 2), "bhsd", True, None),  # the same storage read as bhsd
        (lambda t: t[..., :16].contiguous(), "bshd", False, None),
        (lambda t: t[..., :16].contiguous(), "bshd", True, 0.3),
        (lambda t: t[..., :16].float(), "bshd", True, 0.3),
        (lambda t: t[..., :16].contiguous(), "bshd", True, None),    # back to the first: a reused entry
    ]
    for make_view, layout, causal, scale in variants:
        q, k, v = (make_view(base + i) for i in range(3))
        _forget_pointers(_lib.packed_calls.forward)
        o, lse = flashlm.attention_forward(q, k, v, layout=layout, causal=causal, scale=scale)
        call = _packed_call_of(_lib.packed_calls.forward, q)
        options = (causal, False, scale, False, "flash")
        assert bytes(call.buffer) == _fresh_pack(_lib.FORWARD, (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)),
                                                 layout == "bhsd", options)
        dout = torch.randn(o.shape, dtype=o.dtype)
        _forget_pointers(_lib.packed_calls.backward)
        dq, dk, dv = flashlm.attention_backward(q, k, v, o, lse, dout, layout=layout, causal=causal, scale=scale)
        call = _packed_call_of(_lib.packed_calls.backward, q)
        tensors = (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("dout", dout), ("dq", dq), ("dk", dk),
                   ("dv", dv))
        assert bytes(call.buffer) == _fresh_pack(_lib.BACKWARD, tensors, layout == "bhsd", options)
        ref = reference(*(to_layout(t, layout) for t in (q, k, v)), causal, "top_left", scale)
        assert torch.allclose(to_layout(o, layout), ref.to(o.dtype), atol=1e-5)


def test_autograd_backward_reuses_the_forward_call_only_for_the_same_output_gradient_geometry():
    # The autograd path keys its backward's packed arguments by the forward's PackedCall and dO's geometry
    # alone. Backwards of one forward geometry with dO contiguous, strided (a sliced view) and in another
    # dtype-compatible layout must each pack exactly what a fresh pack gives and give the reference's
    # gradients.
    from flashlm import _lib
    base = [torch.randn(2, 33, 3, 16, dtype=torch.float64) for _ in range(3)]
    ref_q, ref_k, ref_v = (b.clone().requires_grad_(True) for b in base)
    ref = reference(ref_q, ref_k, ref_v, True, "top_left", None)
    douts = [lambda o: torch.randn(o.shape, dtype=o.dtype),
             lambda o: torch.randn(*o.shape[:-1], o.shape[-1] + 5, dtype=o.dtype)[..., :o.shape[-1]],
             lambda o: torch.randn(o.shape[0], o.shape[2], o.shape[1], o.shape[3], dtype=o.dtype).transpose(1, 2),
             lambda o: torch.randn(o.shape, dtype=o.dtype)]  # back to the first: the cached entry
    for make_dout in douts:
        q, k, v = (b.clone().requires_grad_(True) for b in base)
        _forget_pointers(_lib.packed_calls.forward)  # the allocator may hand out an earlier q's address
        for c in _lib.packed_calls.forward.values():
            for b in c.backward.values():
                b.words[75] = 0  # and an earlier dO's
        o = flashlm.attention(q, k, v, layout="bshd", causal=True)
        dout = make_dout(o)
        lse = o.grad_fn.saved_tensors[4]
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), dout)
        rq, rk, rv = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), dout, retain_graph=True)
        for got, want in ((dq, rq), (dk, rk), (dv, rv)):
            assert torch.allclose(got, want, atol=1e-10), (dout.stride(), (got - want).abs().max())
        forward_call = _packed_call_of(_lib.packed_calls.forward, q)
        backward = [c for c in forward_call.backward.values() if c.words[75] == dout.data_ptr()]
        assert len(backward) == 1
        tensors = (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("dout", dout), ("dq", dq), ("dk", dk),
                   ("dv", dv))
        assert bytes(backward[0].buffer) == _fresh_pack(_lib.BACKWARD, tensors, False,
                                                        (True, False, None, False, "flash"))


def test_packed_arguments_are_bounded():
    from flashlm import _lib
    q = torch.randn(1, 2, 1, 8)
    for n in range(1, min(_lib.MAX_PACKED_CALLS, 10_000) + 10):  # more distinct sequence lengths than that
        k = torch.randn(1, n, 1, 8)
        flashlm.attention_forward(q, k, k, layout="bshd")
        assert len(_lib.packed_calls.forward) <= _lib.MAX_PACKED_CALLS


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_casts_the_inputs_as_sdpa_does(device):
    """Inside torch.autocast a model's RoPE'd q, k come out float32 beside a bfloat16 v; SDPA (on autocast's
    lower-precision list) casts all three to the region's dtype, and so does flashlm's attention (eager here;
    compiled and direct torch.ops calls in test_torch_library.py). The gradients come back in the inputs'
    dtypes."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4, 19, 32, generator=g).to(device).requires_grad_(True) for _ in range(2))
    v = torch.randn(2, 4, 19, 32, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(True)
    with torch.autocast(device, dtype=torch.bfloat16):
        o = flashlm.scaled_dot_product_attention(q, k, v, is_causal=True)
        o_bshd = flashlm.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd", causal=True)
    assert o.dtype == torch.bfloat16 and o_bshd.dtype == torch.bfloat16
    assert torch.equal(o_bshd.transpose(1, 2), o)
    want = reference(*(t.detach().to(torch.bfloat16).float().transpose(1, 2) for t in (q, k, v)), True, None, None)
    assert (o.float() - want.transpose(1, 2)).abs().max().item() < 2e-2
    o.float().square().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    # Outside autocast the dtypes must agree, as before.
    with pytest.raises(ValueError, match="dtype"):
        flashlm.scaled_dot_product_attention(q, k, v)
