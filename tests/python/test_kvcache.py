"""flashlm.flash_attn_with_kvcache (decoding over a paged or contiguous KV cache, appended in place) against
a plain torch computation on the gathered cache; the custom operator's opcheck, FakeTensorMode and
torch.compile(fullgraph=True); and, on a GPU, the CUDA kernels against the CPU path and CUDA-graph capture."""
import math

import pytest

torch = pytest.importorskip("torch")
import flashlm  # noqa: E402
from flashlm import torch_ops  # noqa: E402

HAS_OPS = torch_ops.HAS_CUSTOM_OPS
CUDA = torch.cuda.is_available() and flashlm.cuda_device_count() > 0


def make_cache(batch, lens, seq_new, heads_k, d, page_size, dtype, device, seed):
    """A paged cache with its pages shuffled (page_size 0: the contiguous one), the block table (-1 in unused
    entries), and new rows."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lens) + seq_new
    if page_size:
        max_pages = -(-longest // page_size) + 1
        num_pages = batch * max_pages + 2
        perm = torch.randperm(num_pages, generator=g).tolist()
        table = torch.full((batch, max_pages), -1, dtype=torch.int32)
        nxt = 0
        for b in range(batch):
            for i in range(-(-(lens[b] + seq_new) // page_size)):
                table[b, i] = perm[nxt]
                nxt += 1
        shape = (num_pages, page_size, heads_k, d)
    else:
        table = None
        shape = (batch, longest + 3, heads_k, d)
    kc = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    vc = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    kn = vn = None
    if seq_new:
        kn = torch.randn((batch, seq_new, heads_k, d), generator=g, dtype=torch.float64).to(dtype)
        vn = torch.randn((batch, seq_new, heads_k, d), generator=g, dtype=torch.float64).to(dtype)
    to = (lambda t: None if t is None else t.to(device))
    return to(kc), to(vc), to(table), to(kn), to(vn)


def gather(cache, table, b, n, page_size):
    """The first n keys of sequence b as [n, heads_k, d]."""
    if table is None:
        return cache[b, :n]
    rows = [cache[table[b, j // page_size], j % page_size] for j in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:]))


def reference(q, kc, vc, table, lens, kn, vn, page_size, causal, scale, window, softcap):
    """Plain float64 torch attention per sequence over the gathered cache (with the new rows), bottom-right."""
    batch, nq, hq, d = q.shape
    hk = kc.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros((batch, nq, hq, d), dtype=torch.float64)
    lse = torch.full((batch, hq, nq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        keys = gather(kc.cpu().double(), None if table is None else table.cpu(), b, lens[b], page_size)
        vals = gather(vc.cpu().double(), None if table is None else table.cpu(), b, lens[b], page_size)
        if kn is not None:
            keys = torch.cat([keys, kn[b].cpu().double()])
            vals = torch.cat([vals, vn[b].cpu().double()])
        n = keys.shape[0]
        keys = keys.repeat_interleave(hq // hk, dim=1)  # [n, hq, d]
        vals = vals.repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b].cpu().double(), keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(nq).view(-1, 1) + n - nq
        j = torch.arange(n).view(1, -1)
        visible = torch.ones((nq, n), dtype=torch.bool)
        left, right = window
        if causal:
            right = 0
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        s = s.masked_fill(~visible, -math.inf)
        m = s.amax(-1, keepdim=True)
        any_key = visible.any(-1).view(1, nq, 1)
        p = torch.where(any_key, torch.exp(s - torch.where(any_key, m, torch.zeros_like(m))), torch.zeros_like(s))
        total = p.sum(-1, keepdim=True)
        out[b] = torch.einsum("hqk,khd->qhd", p / torch.where(total > 0, total, torch.ones_like(total)), vals)
        lse[b] = torch.where(total[..., 0] > 0, (m + torch.log(total))[..., 0], torch.full_like(total[..., 0], -math.inf))
    return out, lse


CASES = [
    # batch, nq, hq, hk, d, page_size, lens, seq_new, causal, window, softcap, scale
    (3, 1, 8, 2, 32, 16, [37, 0, 100], 1, True, (-1, -1), 0.0, None),
    (2, 4, 8, 1, 32, 32, [70, 3], 4, True, (-1, -1), 0.0, None),
    (2, 3, 4, 4, 16, 0, [20, 1], 0, False, (-1, -1), 0.0, 0.3),
    (2, 2, 4, 2, 32, 16, [90, 12], 2, True, (10, -1), 1.5, None),
    (2, 4, 4, 4, 16, 48, [60, 5], 0, False, (6, 3), 0.0, None),
]


def run_case(case, dtype, device, seed=0):
    batch, nq, hq, hk, d, ps, lens, seq_new, causal, window, softcap, scale = case
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn((batch, nq, hq, d), generator=g, dtype=torch.float64).to(dtype).to(device)
    kc, vc, table, kn, vn = make_cache(batch, lens, seq_new, hk, d, ps, dtype, device, seed)
    kc0, vc0 = kc.clone(), vc.clone()
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    out, lse = flashlm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table,
                                               softmax_scale=scale, causal=causal, window_size=window,
                                               softcap=softcap, return_softmax_lse=True)
    return q, kc0, vc0, kc, vc, table, kn, vn, lens, out, lse


def expected_cache(cache0, table, lens, new, page_size):
    want = cache0.clone()
    if new is None:
        return want
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            j = lens[b] + t
            if table is None:
                want[b, j] = new[b, t]
            else:
                want[table[b, j // page_size], j % page_size] = new[b, t]
    return want


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matches_torch_on_the_gathered_cache(case, dtype):
    q, kc0, vc0, kc, vc, table, kn, vn, lens, out, lse = run_case(case, dtype, "cpu")
    ps, causal, window, softcap, scale = case[5], case[8], case[9], case[10], case[11]
    want, want_lse = reference(q, kc0, vc0, table, lens, kn, vn, ps, causal, scale, window, softcap)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=0)
    assert torch.equal(kc, expected_cache(kc0, table, lens, kn, ps))
    assert torch.equal(vc, expected_cache(vc0, table, lens, vn, ps))


def test_plain_output_and_int_seqlens():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    out = flashlm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, causal=True)
    want, _ = reference(q, kc, vc, None, [7, 7], None, None, 0, True, None, (-1, -1), 0.0)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)


def test_bad_arguments_name_themselves():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(flashlm.FlashlmValueError, match="cache_seqlens.*int32"):
        flashlm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens.long())
    with pytest.raises(flashlm.FlashlmValueError, match="cache_seqlens.*batch = 2"):
        flashlm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens[:1])
    with pytest.raises(flashlm.FlashlmValueError, match="k, v"):
        flashlm.flash_attn_with_kvcache(q, kc, vc, k=torch.randn(2, 1, 2, 16), cache_seqlens=lens)
    with pytest.raises(flashlm.FlashlmValueError, match="rotary_cos"):
        flashlm.flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(1), cache_seqlens=lens)
    with pytest.raises(flashlm.FlashlmValueError, match="sequence 1 holds 11 keys"):
        flashlm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 11], dtype=torch.int32))
    table = torch.tensor([[0], [5]], dtype=torch.int32)
    paged_k, paged_v = torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16)
    with pytest.raises(flashlm.FlashlmValueError, match="block_table.*not a page"):
        flashlm.flash_attn_with_kvcache(q, paged_k, paged_v, cache_seqlens=lens, block_table=table)


needs_ops = pytest.mark.skipif(not HAS_OPS, reason=f"torch {torch.__version__} has no torch.library.custom_op")


def op_args(device="cpu", dtype=torch.float32, head_dim=32):
    q = torch.randn(2, 2, 4, head_dim, dtype=dtype, device=device)
    kc, vc, table, kn, vn = make_cache(2, [20, 5], 2, 2, head_dim, 16, dtype, device, 3)
    lens = torch.tensor([20, 5], dtype=torch.int32, device=device)
    return q, kc, vc, lens, table, kn, vn


@needs_ops
def test_opcheck():
    q, kc, vc, lens, table, kn, vn = op_args()
    torch.library.opcheck(torch.ops.flashlm.attention_with_kvcache.default,
                          (q, kc, vc, lens, table, kn, vn, True, None, -1, -1, 0.0))
    torch.library.opcheck(torch.ops.flashlm.attention_with_kvcache.default,
                          (q, kc[:2].contiguous(), vc[:2].contiguous(), torch.tensor([10, 16], dtype=torch.int32),
                           None, None, None, False, 0.5, 4, -1, 0.0))


@needs_ops
def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 2, 8, 64, dtype=torch.bfloat16)
        kc = torch.empty(10, 16, 2, 64, dtype=torch.bfloat16)
        lens = torch.empty(3, dtype=torch.int32)
        table = torch.empty(3, 4, dtype=torch.int32)
        o, lse = torch.ops.flashlm.attention_with_kvcache(q, kc, kc.clone(), lens, table, None, None, True, None)
        assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (3, 8, 2) and lse.dtype == torch.float32


@needs_ops
def test_compile_fullgraph_mutates_the_cache():
    q, kc, vc, lens, table, kn, vn = op_args()
    kc_eager, vc_eager = kc.clone(), vc.clone()
    want = flashlm.flash_attn_with_kvcache(q, kc_eager, vc_eager, kn, vn, cache_seqlens=lens, block_table=table,
                                           causal=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, kc, vc, kn, vn, lens, table):
        return flashlm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                               causal=True) * 2

    got = step(q, kc, vc, kn, vn, lens, table)
    torch.testing.assert_close(got, want * 2)
    assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)


needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device visible to torch and flashlm")


@needs_cuda
@pytest.mark.parametrize("case", [c[:4] + (64,) + c[5:] for c in CASES])
def test_cuda_matches_torch_on_the_gathered_cache(case):
    q, kc0, vc0, kc, vc, table, kn, vn, lens, out, lse = run_case(case, torch.bfloat16, "cuda")
    ps, causal, window, softcap, scale = case[5], case[8], case[9], case[10], case[11]
    want, want_lse = reference(q, kc0, vc0, table, lens, kn, vn, ps, causal, scale, window, softcap)
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), want_lse, atol=1e-3, rtol=0)
    assert torch.equal(kc, expected_cache(kc0, table, lens, kn, ps))


@needs_cuda
def test_cuda_graph_capture_and_replay():
    q, kc, vc, lens, table, kn, vn = op_args("cuda", torch.bfloat16, head_dim=64)  # (the CUDA kernels: D 64/128/256)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = flashlm.flash_attn_with_kvcache(q, kc_ref, vc_ref, kn, vn, cache_seqlens=lens, block_table=table,
                                           causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        flashlm.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, block_table=table,
                                        causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashlm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
