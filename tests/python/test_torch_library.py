"""flashlm's attention as torch.library custom operators: opcheck, torch.compile(fullgraph=True) forward and
backward, torch.export, torch.func.grad, FakeTensorMode, double backward, and (on a GPU) CUDA-graph capture.
Skipped on a torch without torch.library.custom_op (there the autograd.Function path is tested by
test_torch_attention.py)."""
import math

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.custom_op", allow_module_level=True)
import flashlm  # noqa: E402
from flashlm import torch_ops  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashlm.cuda_device_count() > 0 else [])


def rand(shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_(True)


def sdpa_reference(q, k, v, causal):
    """F.scaled_dot_product_attention in float64 on bhsd tensors, top-left causal mask."""
    q, k, v = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    return q, k, v, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_ops_are_registered():
    assert torch_ops.HAS_CUSTOM_OPS
    assert hasattr(torch.ops.flashlm, "attention_fwd") and hasattr(torch.ops.flashlm, "attention_bwd")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
def test_opcheck_forward_and_backward(device, causal, bottom_right):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = rand((2, 13, 4, 32), dtype, device, 1)
    k, v = rand((2, 21, 2, 32), dtype, device, 2), rand((2, 21, 2, 32), dtype, device, 3)
    torch.library.opcheck(torch.ops.flashlm.attention_fwd.default, (q, k, v, "bshd", causal, bottom_right, None, False, "flash"))
    qh, kh, vh = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashlm.attention_fwd.default, (qh, kh, vh, "bhsd", causal, bottom_right, None, False, "flash"))
    o, lse = torch.ops.flashlm.attention_fwd(q, k, v, "bshd", causal, bottom_right, 0.2, False, "flash")
    dout = torch.randn_like(o)
    args = (dout, q.detach(), k.detach(), v.detach(), o.detach(), lse, "bshd", causal, bottom_right, 0.2, False, "flash")
    torch.library.opcheck(torch.ops.flashlm.attention_bwd.default, args)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 17, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(3, 40, 2, 64, dtype=torch.bfloat16)
        o, lse = torch.ops.flashlm.attention_fwd(q, k, k, "bshd", True, True, None, False, "flash")
        assert o.shape == q.shape and o.dtype == q.dtype and o.stride() == q.stride()
        assert lse.shape == (3, 8, 17) and lse.dtype == torch.float32
        qh = torch.empty(3, 8, 17, 64, dtype=torch.bfloat16)  # bhsd
        kh = torch.empty(3, 2, 40, 64, dtype=torch.bfloat16)
        oh, lseh = torch.ops.flashlm.attention_fwd(qh, kh, kh, "bhsd", False, False, None, False, "flash")
        assert oh.shape == qh.shape and oh.stride() == qh.stride() and lseh.shape == (3, 8, 17)
        dq, dk, dv, _ = torch.ops.flashlm.attention_bwd(o, q, k, k, o, lse, "bshd", True, True, None, False, "flash")
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_real_outputs_match_the_fake_strides():
    q = rand((2, 4, 9, 16)).detach().transpose(1, 2)  # bhsd storage seen as bshd
    k = rand((2, 4, 9, 16), seed=1).detach().transpose(1, 2)
    o, lse = torch.ops.flashlm.attention_fwd(q, k, k, "bshd", False, False, None, False, "flash")
    assert o.stride() == q.stride() and lse.shape == (2, 4, 9) and lse.is_contiguous()
    oh, lseh = torch.ops.flashlm.attention_fwd(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), "bhsd", False,
                                               False, None, False, "flash")
    assert torch.equal(oh, o.transpose(1, 2)) and torch.equal(lseh, lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_forward_and_backward(device, dynamic):
    torch._dynamo.reset()
    q, k, v = (rand((2, 4, 33, 32), torch.float32, device, s) for s in (4, 5, 6))

    def loss(q, k, v):
        o = flashlm.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (o * o).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    got = compiled(q, k, v)
    grads = torch.autograd.grad(got, (q, k, v))
    q64, k64, v64, o64 = sdpa_reference(q, k, v, True)
    want = (o64 * o64).sum()
    want_grads = torch.autograd.grad(want, (q64, k64, v64))
    assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item())
    for g, w in zip(grads, want_grads):
        assert (g.double().cpu() - w).abs().max().item() < 1e-4
    # No graph break: explain() sees one graph.
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compile_fullgraph_with_inductor_cpu():
    """The default backend: inductor compiles the surrounding graph, the custom ops stay calls."""
    torch._dynamo.reset()
    q, k, v = (rand((1, 17, 2, 16), seed=s) for s in (7, 8, 9))

    def f(q, k, v):
        return flashlm.flash_attn_func(q * 2, k, v, causal=True).sin().sum()

    got = torch.compile(f, fullgraph=True)(q, k, v)
    dq = torch.autograd.grad(got, q)[0]
    want = f(q, k, v)
    dq_want = torch.autograd.grad(want, q)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.allclose(dq, dq_want, rtol=1e-4, atol=1e-5)


def test_export():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flashlm.attention(q, k, v, layout="bhsd", causal=True)

    q, k, v = (rand((2, 3, 20, 16), seed=s).detach() for s in (1, 2, 3))
    exported = torch.export.export(Attention(), (q, k, v))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.flashlm.attention_fwd.default in targets
    q2, k2, v2 = (rand((2, 3, 20, 16), seed=s).detach() for s in (4, 5, 6))
    assert torch.equal(exported.module()(q2, k2, v2), flashlm.attention(q2, k2, v2, layout="bhsd", causal=True))


def test_func_grad_matches_autograd():
    q, k, v = (rand((1, 2, 11, 8), torch.float64, seed=s).detach() for s in (1, 2, 3))

    def loss(q, k, v):
        return flashlm.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum()

    dq, dk, dv = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    q64, k64, v64, o64 = sdpa_reference(q, k, v, True)
    want = torch.autograd.grad(o64.pow(2).sum(), (q64, k64, v64))
    for g, w in zip((dq, dk, dv), want):
        assert (g - w).abs().max().item() < 1e-10


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_is_refused_clearly_through_the_ops(device):
    q, k, v = (rand((1, 9, 2, 16), torch.float32, device, s) for s in (1, 2, 3))
    (dq,) = torch.autograd.grad(flashlm.attention(q, k, v, layout="bshd").square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        dq.sum().backward()


def test_lse_is_not_differentiable():
    q, k, v = (rand((1, 5, 2, 8), seed=s) for s in (1, 2, 3))
    o, lse = torch.ops.flashlm.attention_fwd(q, k, v, "bshd", False, False, None, False, "flash")
    assert o.requires_grad and not lse.requires_grad


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_graph_capture_of_forward_and_backward(causal):
    """Forward + backward captured in one CUDA graph, replayed on new inputs copied into the static ones."""
    shape = (2, 4, 200, 64)
    static = [rand(shape, torch.bfloat16, "cuda", s) for s in (1, 2, 3)]
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def attend(q, k, v):  # deterministic dQ, so that the replay and the eager run agree bit for bit
        return flashlm.attention(q, k, v, layout="bhsd", causal=causal, deterministic=True)

    def step():
        o = attend(*static)
        return (o, *torch.autograd.grad(o, static, dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture (kernel attributes, the allocator's pools)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (10, 20):
        fresh = [rand(shape, torch.bfloat16, "cuda", seed + i).detach() for i in range(3)]
        for s, f in zip(static, fresh):
            s.data.copy_(f)
        for o in outs:
            o.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        eager = [attend(*(f.requires_grad_(True) for f in fresh))]
        eager += list(torch.autograd.grad(eager[0], fresh, dout))
        for got, want in zip(outs, eager):
            assert torch.equal(got, want), (got - want).abs().max().item()


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_compile_fullgraph_cuda_inductor_bf16():
    torch._dynamo.reset()
    q, k, v = (rand((2, 8, 256, 64), torch.bfloat16, "cuda", s) for s in (1, 2, 3))

    def f(q, k, v):
        return flashlm.attention(q, k, v, layout="bhsd", causal=True, deterministic=True).float().square().mean()

    got = torch.compile(f, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(got, (q, k, v))
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v))
    assert math.isclose(got.item(), want.item(), rel_tol=1e-3)
    for g, w in zip(grads, want_grads):  # inductor may round the loss's own ops differently: bf16 tolerance
        assert torch.allclose(g.float(), w.float(), rtol=2e-2, atol=1e-4), (g.float() - w.float()).abs().max().item()


def test_grad_of_grad_under_torch_func_is_refused_clearly():
    q, k, v = (rand((1, 2, 7, 8), torch.float64, seed=s).detach() for s in (1, 2, 3))

    def loss(q):
        return flashlm.scaled_dot_product_attention(q, k, v).pow(2).sum()

    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).sum())(q)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_casts_q_k_v_and_leaves_alibi_slopes_and_sinks_in_float32(device):
    """Autocast casts the attention's inputs, not its float32 parameters: ALiBi slopes and learnable sinks keep
    their dtype (the operators refuse them in any other), for direct torch.ops callers and in compiled code, and
    the sink's gradient comes back float32. (Casting every floating argument had the op refuse them.)"""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 17, 4, 32, generator=g).to(device) for _ in range(3))
    slopes = torch.rand(4, generator=g).to(device)
    sink = torch.randn(4, generator=g).to(device)
    dtype = torch.bfloat16
    with torch.autocast(device, dtype=dtype):
        o, lse = torch.ops.flashlm.attention_fwd(q, k, v, "bshd", True, False, None, False, "flash", -1, -1, 0.0,
                                                 slopes, sink)
    want, want_lse = torch.ops.flashlm.attention_fwd(*(t.to(dtype) for t in (q, k, v)), "bshd", True, False, None,
                                                     False, "flash", -1, -1, 0.0, slopes, sink)
    assert o.dtype == dtype and torch.equal(o, want) and torch.equal(lse, want_lse)

    torch._dynamo.reset()
    sink_g = sink.clone().requires_grad_(True)

    def loss(q, k, v, sink):
        with torch.autocast(device, dtype=dtype):
            return flashlm.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                           learnable_sink=sink).float().square().sum()

    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, sink_g)
    dsink = torch.autograd.grad(got, sink_g)[0]
    assert dsink.dtype == torch.float32 and bool(torch.isfinite(dsink).all())
    eager = loss(q, k, v, sink_g)
    assert abs(got.item() - eager.item()) <= 1e-3 * abs(eager.item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_the_regions_dtype_in_ops_and_compiled_code(device, dtype):
    """The operators' Autocast kernels cast floating inputs to the region's dtype (bfloat16 or float16, as SDPA's
    lower-precision rule does) for direct torch.ops callers and in compiled code; the offsets stay int32."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 17, 4, 32, generator=g).to(device) for _ in range(2))
    v = torch.randn(2, 17, 4, 32, generator=g).to(device=device, dtype=torch.bfloat16)
    with torch.autocast(device, dtype=dtype):
        o, lse = torch.ops.flashlm.attention_fwd(q, k, v, "bshd", True, False, None, False, "flash")
        cu = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
        ov, _ = torch.ops.flashlm.attention_varlen_fwd(q[0], k[0], v[0], cu, cu, 12, 12, True, True, None, False,
                                                       "flash")
    assert o.dtype == dtype and lse.dtype == torch.float32 and ov.dtype == dtype
    want, _ = torch.ops.flashlm.attention_fwd(*(t.to(dtype) for t in (q, k, v)), "bshd", True, False, None, False,
                                              "flash")
    assert torch.equal(o, want)

    torch._dynamo.reset()
    qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)

    def loss(q, k, v):
        with torch.autocast(device, dtype=dtype):
            return flashlm.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        is_causal=True).float().square().sum()

    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(qg, kg, v)
    dq = torch.autograd.grad(got, qg)[0]
    assert dq.dtype == torch.float32
    assert abs(got.item() - want.float().square().sum().item()) <= 1e-3 * abs(got.item())
