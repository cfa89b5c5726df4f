"""The FP8 forward from PyTorch: torch.float8_e4m3fn q, k, v with q/k/v_descale in flashlm.attention. On the
CPU and on an sm_90 GPU the result against float64 attention of the dequantised inputs; the fake kernel gives
the bfloat16 output's shape."""
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
