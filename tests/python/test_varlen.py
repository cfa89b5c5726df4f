"""flashlm.flash_attn_varlen_func (packed variable-length sequences, flash-attn's convention) against
per-sequence float64 attention on ragged packs: forward, backward, lse layout, both causal alignments, GQA,
empty sequences, bad offsets; and (on a torch with torch.library.custom_op) opcheck and
torch.compile(fullgraph=True) over the varlen operators. GPU cases skip without a GPU."""
import math

import pytest

torch = pytest.importorskip("torch")
import flashlm  # noqa: E402
from flashlm import torch_ops  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashlm.cuda_device_count() > 0 else [])
needs_ops = pytest.mark.skipif(not torch_ops.HAS_CUSTOM_OPS, reason="torch has no torch.library.custom_op")


def offsets(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def pack(len_q, len_k, hq, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(n, h):
        return torch.randn((n, h, d), generator=g, dtype=torch.float64).to(dtype=dtype, device=device)

    return rand(sum(len_q), hq), rand(sum(len_k), hk), rand(sum(len_k), hk)


def reference(q, k, v, len_q, len_k, causal, bottom_right, scale=None):
    """Per-sequence attention in float64 on the CPU with autograd: (o, lse [heads_q, total_q], inputs).
    A query that sees no key gets o = 0 and lse = -inf."""
    q, k, v = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    qi = ki = 0
    for lq, lk in zip(len_q, len_k):
        qs = q[qi:qi + lq].transpose(0, 1)                                   # [hq, lq, d]
        ks = k[ki:ki + lk].transpose(0, 1).repeat_interleave(group, dim=0)  # [hq, lk, d]
        vs = v[ki:ki + lk].transpose(0, 1).repeat_interleave(group, dim=0)
        s = qs @ ks.transpose(1, 2) * (scale if scale is not None else 1 / math.sqrt(q.shape[2]))
        i = torch.arange(lq).unsqueeze(1)
        j = torch.arange(lk).unsqueeze(0)
        visible = (j <= i + (lk - lq if bottom_right else 0)) if causal else torch.ones(lq, lk, dtype=torch.bool)
        seen = visible.any(dim=1, keepdim=True)
        s = torch.where(visible & seen, s, torch.tensor(-math.inf, dtype=torch.float64))
        s = torch.where(seen, s, torch.zeros((), dtype=torch.float64))  # rows that see nothing: finite, then zeroed
        p = torch.softmax(s, dim=-1) * seen
        outs.append((p @ vs).transpose(0, 1))
        lse = torch.logsumexp(s, dim=-1)
        lses.append(torch.where(seen.squeeze(1), lse, torch.tensor(-math.inf, dtype=torch.float64)))
        qi, ki = qi + lq, ki + lk
    return torch.cat(outs, 0), torch.cat(lses, 1), (q, k, v)


LENGTHS = [([1, 17, 300, 0, 5, 64], [1, 17, 300, 0, 5, 64]),   # self-attention, an empty sequence
           ([5, 0, 40, 17, 9], [9, 30, 0, 17, 100])]          # cross: no queries, no keys, len_q != len_k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("causal,causal_align", [(False, None), (True, None), (True, "top_left")])
def test_matches_per_sequence_reference(device, lengths, causal, causal_align):
    len_q, len_k = lengths
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = pack(len_q, len_k, 4, 2, 32, dtype, device, seed=len(len_q))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    cu_q, cu_k = offsets(len_q, device), offsets(len_k, device)
    o = flashlm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(len_q), max(len_k), causal=causal,
                                       causal_align=causal_align)
    dout = torch.randn_like(o)
    o.backward(dout)
    bottom_right = causal_align is None  # flash-attn's default
    ref_o, ref_lse, (rq, rk, rv) = reference(q, k, v, len_q, len_k, causal, bottom_right)
    ref_o.backward(dout.double().cpu())
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.double().cpu(), ref_o.detach(), atol=tol, rtol=tol)
    for got, want in ((q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad)):
        torch.testing.assert_close(got.double().cpu(), want, atol=tol * 4, rtol=tol)
    _, lse = flashlm.attention_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max(len_q),
                                              max(len_k), causal=causal,
                                              causal_align="bottom_right" if bottom_right else "top_left")
    assert lse.shape == (4, sum(len_q)) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-3, rtol=1e-4)


def test_keys_of_a_sequence_without_queries_get_zero_gradients():
    len_q, len_k = [3, 0, 4], [3, 6, 4]
    q, k, v = pack(len_q, len_k, 2, 2, 16, torch.float32, "cpu", seed=3)
    k.requires_grad_(True)
    o = flashlm.flash_attn_varlen_func(q, k, v, offsets(len_q), offsets(len_k), 4, 6, causal=True)
    o.sum().backward()
    assert torch.count_nonzero(k.grad[3:9]) == 0
    assert torch.count_nonzero(k.grad[:3]) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_bad_offsets_are_refused_with_their_name(device):
    q, k, v = pack([3, 5], [4, 4], 2, 2, 16, torch.float32 if device == "cpu" else torch.bfloat16, device)
    cu_q, cu_k = offsets([3, 5], device), offsets([4, 4], device)

    def call(cq=cu_q, ck=cu_k, max_q=5, max_k=4, qq=q, **kw):
        return flashlm.flash_attn_varlen_func(qq, k, v, cq, ck, max_q, max_k, **kw)

    with pytest.raises(flashlm.FlashlmValueError, match="cu_seqlens_q: expected dtype torch.int32"):
        call(cq=cu_q.long())
    with pytest.raises(flashlm.FlashlmValueError, match="cu_seqlens_k: 2 offsets, but cu_seqlens_q has 3"):
        call(ck=cu_k[:2])
    with pytest.raises(flashlm.FlashlmValueError, match="cu_seqlens_q: the offsets decrease at sequence 1"):
        call(cq=torch.tensor([0, 5, 3], dtype=torch.int32, device=device))
    with pytest.raises(flashlm.FlashlmValueError, match="cu_seqlens_k: the last offset is 7"):
        call(ck=torch.tensor([0, 4, 7], dtype=torch.int32, device=device))
    with pytest.raises(flashlm.FlashlmValueError, match="sequence 1 has length 5, more than max_seqlen_q = 4"):
        call(max_q=4)
    with pytest.raises(flashlm.FlashlmValueError, match="q: expected 3 dimensions"):
        call(qq=q.unsqueeze(0))
    with pytest.raises(flashlm.FlashlmValueError, match="dropout_p"):
        call(dropout_p=0.1)
    with pytest.raises(flashlm.FlashlmValueError, match="block_table"):
        call(block_table=torch.zeros(1))


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
def test_opcheck_varlen_forward_and_backward(device, causal, bottom_right):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    len_q, len_k = [3, 0, 13, 1], [5, 2, 13, 0]
    q, k, v = (t.requires_grad_(True) for t in pack(len_q, len_k, 4, 2, 32, dtype, device, 1))
    cu_q, cu_k = offsets(len_q, device), offsets(len_k, device)
    fwd = torch.ops.flashlm.attention_varlen_fwd
    torch.library.opcheck(fwd.default, (q, k, v, cu_q, cu_k, 13, 13, causal, bottom_right, None, False, "flash"))
    o, lse = fwd(q, k, v, cu_q, cu_k, 13, 13, causal, bottom_right, 0.3, False, "flash")
    args = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse, cu_q, cu_k, 13, 13, causal,
            bottom_right, 0.3, False, "flash")
    torch.library.opcheck(torch.ops.flashlm.attention_varlen_bwd.default, args)


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_varlen_forward_and_backward(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    len_q = [7, 0, 40, 1]
    cu = offsets(len_q, device)

    def loss(q, k, v):
        return flashlm.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True).square().sum()

    inputs = [t.requires_grad_(True) for t in pack(len_q, len_q, 4, 1, 32, dtype, device, 5)]
    want = loss(*inputs)
    want_grads = torch.autograd.grad(want, inputs)
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs)
    got_grads = torch.autograd.grad(got, inputs)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@needs_ops
def test_fake_varlen_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(50, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(70, 2, 64, dtype=torch.bfloat16)
        cu = torch.empty(4, dtype=torch.int32)
        o, lse = torch.ops.flashlm.attention_varlen_fwd(q, k, k, cu, cu, 30, 30, True, True, None, False, "flash")
        assert o.shape == q.shape and o.stride() == q.stride() and lse.shape == (8, 50) and lse.dtype == torch.float32


@needs_ops
def test_compile_fullgraph_cross_attention_offsets():
    len_q, len_k = [3, 0, 20], [8, 4, 0]
    cu_q, cu_k = offsets(len_q), offsets(len_k)

    def f(q, k, v):
        return flashlm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 8, causal=True)

    q, k, v = (t.requires_grad_(True) for t in pack(len_q, len_k, 2, 2, 16, torch.float32, "cpu", 9))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, f(q, k, v))
    assert torch.count_nonzero(got[3:]) == 0  # the last sequence has no keys


@needs_ops
def test_func_grad_matches_autograd():
    len_q = [5, 12]
    cu = offsets(len_q)
    q, k, v = pack(len_q, len_q, 2, 1, 16, torch.float64, "cpu", 11)

    def loss(q):
        return flashlm.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True).sin().sum()

    got = torch.func.grad(loss)(q)
    qr = q.clone().requires_grad_(True)
    loss(qr).backward()
    torch.testing.assert_close(got, qr.grad)


@needs_ops
def test_export_varlen():
    class Packed(torch.nn.Module):
        def forward(self, q, k, v, cu):
            return flashlm.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)

    len_q = [5, 12, 0]
    q, k, v = pack(len_q, len_q, 2, 2, 16, torch.float32, "cpu", 13)
    cu = offsets(len_q)
    exported = torch.export.export(Packed(), (q, k, v, cu))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.flashlm.attention_varlen_fwd.default in targets
    q2, k2, v2 = pack(len_q, len_q, 2, 2, 16, torch.float32, "cpu", 14)
    assert torch.equal(exported.module()(q2, k2, v2, cu), Packed()(q2, k2, v2, cu))


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_cuda_graph_capture_with_host_offsets():
    """Host (CPU) offsets need no read-back, so forward + backward capture in a CUDA graph; the replay on new
    inputs matches eager calls bit for bit (deterministic dQ)."""
    len_q = [17, 200, 1, 0, 64]
    cu = offsets(len_q)  # on the CPU
    static = [t.requires_grad_(True) for t in pack(len_q, len_q, 4, 2, 64, torch.bfloat16, "cuda", 1)]
    dout = torch.randn_like(static[0])

    def attend(q, k, v):
        return flashlm.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True, deterministic=True)

    def step():
        o = attend(*static)
        return (o, *torch.autograd.grad(o, static, dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    fresh = [t.detach() for t in pack(len_q, len_q, 4, 2, 64, torch.bfloat16, "cuda", 7)]
    for s, f in zip(static, fresh):
        s.data.copy_(f)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = [attend(*(f.requires_grad_(True) for f in fresh))]
    eager += list(torch.autograd.grad(eager[0], fresh, dout))
    for got, want in zip(outs, eager):
        assert torch.equal(got, want), (got - want).abs().max().item()
