import sys, time, torch
sys.path.insert(0, "scripts")
import torch_op_overhead as t
q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
f = t.bare_forward(q, k, v, True); b = t.bare_backward(q, k, v, True)
for _ in range(3):
    for fn, name in ((f, "fwd"), (b, "bwd")):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(20000): fn()
        torch.cuda.synchronize(); print(name, (time.perf_counter() - t0) / 20000 * 1e6, "us", flush=True)
