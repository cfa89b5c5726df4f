"""The signatures users know: flashlm.flash_attn_func (flash-attn's: bshd, bottom-right causal) and
flashlm.scaled_dot_product_attention (SDPA's: bhsd, top-left causal) against a float64 reference, forward
and backward; the generic flashlm.attention's explicit layout and causal alignment; refused options."""
import pytest

torch = pytest.importorskip("torch")
import flashlm  # noqa: E402
from test_torch_attention import DEVICES, reference  # noqa: E402  (the float64 oracle on bshd tensors)


def rand(shape, device, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_(True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k,heads_q,heads_k", [(17, 17, 4, 4), (5, 40, 4, 2), (33, 20, 2, 1)])
def test_flash_attn_func_is_bshd_and_bottom_right(device, causal, seq_q, seq_k, heads_q, heads_k):
    if causal and seq_q > seq_k:
        pytest.skip("bottom-right rows that see no key: covered by test_torch_attention")
    q = rand((2, seq_q, heads_q, 32), device, 1)
    k, v = rand((2, seq_k, heads_k, 32), device, 2), rand((2, seq_k, heads_k, 32), device, 3)
    o = flashlm.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3)
    assert o.shape == q.shape
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal, "bottom_right", 0.3)
    want = torch.autograd.grad(o64, (q64, k64, v64), dout.double().cpu())
    assert (o.double().cpu() - o64).abs().max().item() < 3e-5
    for g, w in zip(grads, want):
        assert (g.double().cpu() - w).abs().max().item() < 3e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k,heads_q,heads_k", [(17, 17, 4, 4), (5, 40, 4, 2), (33, 20, 2, 1)])
def test_scaled_dot_product_attention_is_bhsd_and_top_left(device, causal, seq_q, seq_k, heads_q, heads_k):
    q = rand((2, heads_q, seq_q, 16), device, 4)
    k, v = rand((2, heads_k, seq_k, 16), device, 5), rand((2, heads_k, seq_k, 16), device, 6)
    o = flashlm.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads_q != heads_k)
    assert o.shape == q.shape
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    q64, k64, v64 = (t.detach().transpose(1, 2).double().cpu().requires_grad_(True) for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal, "top_left", None)
    want = torch.autograd.grad(o64, (q64, k64, v64), dout.transpose(1, 2).double().cpu())
    assert (o.transpose(1, 2).double().cpu() - o64).abs().max().item() < 3e-5
    for g, w in zip(grads, want):
        assert (g.transpose(1, 2).double().cpu() - w).abs().max().item() < 3e-5


@pytest.mark.skipif(not hasattr(torch.nn.functional, "scaled_dot_product_attention"), reason="torch < 2.0")
def test_scaled_dot_product_attention_matches_torch_sdpa_in_float64():
    q, k, v = (rand((1, 3, 29, 8), "cpu", s, torch.float64) for s in (1, 2, 3))
    for causal in (False, True):
        got = flashlm.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5)
        assert (got - want).abs().max().item() < 1e-12


def test_generic_attention_needs_a_layout_and_an_alignment_when_it_matters():
    q, k = rand((1, 5, 2, 8), "cpu", 1), rand((1, 9, 2, 8), "cpu", 2)
    with pytest.raises(TypeError, match="layout"):
        flashlm.attention(q, k, k)
    with pytest.raises(ValueError, match="causal_align: seq_q = 5 differs from seq_k = 9"):
        flashlm.attention(q, k, k, layout="bshd", causal=True)
    # Equal lengths: both alignments are the same mask, none needs naming; not causal: nothing to align.
    flashlm.attention(q, q, q, layout="bshd", causal=True)
    flashlm.attention(q, k, k, layout="bshd")
    tl = flashlm.attention(q, k, k, layout="bshd", causal=True, causal_align="top_left")
    br = flashlm.attention(q, k, k, layout="bshd", causal=True, causal_align="bottom_right")
    assert not torch.allclose(tl, br)
    with pytest.raises(ValueError, match="causal_align: 'middle'"):
        flashlm.attention(q, k, k, layout="bshd", causal=True, causal_align="middle")


def test_refused_options_are_clear_errors():
    q = rand((1, 6, 2, 8), "cpu", 1)
    qh = q.detach().transpose(1, 2)
    with pytest.raises(ValueError, match="dropout_p: 0.1 given, but flashlm attention has no dropout"):
        flashlm.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p: 0.1 given"):
        flashlm.scaled_dot_product_attention(qh, qh, qh, dropout_p=0.1)
    with pytest.raises(ValueError, match="attn_mask: flashlm attention takes no mask tensor"):
        flashlm.scaled_dot_product_attention(qh, qh, qh, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="window_size: expected a pair of ints"):
        flashlm.flash_attn_func(q, q, q, window_size=(4, 0, 1))
    with pytest.raises(ValueError, match="softcap: expected a finite number >= 0"):
        flashlm.flash_attn_func(q, q, q, softcap=-30.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashlm.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3))  # 2 heads: [2] or [1, 2]
    with pytest.raises(ValueError, match="return_attn_probs"):
        flashlm.flash_attn_func(q, q, q, return_attn_probs=True)
    k1 = qh[:, :1]
    with pytest.raises(ValueError, match="enable_gqa: query has 2 heads and key/value 1/1"):
        flashlm.scaled_dot_product_attention(qh, k1, k1)
    with pytest.raises(ValueError, match="query: expected 4 dimensions \\(bhsd\\)"):
        flashlm.scaled_dot_product_attention(qh[0], qh[0], qh[0])
    with pytest.raises(ValueError, match="q: expected 4 dimensions \\(bshd\\)"):
        flashlm.flash_attn_func(q[0], q[0], q[0])
