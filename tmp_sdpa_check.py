import torch, torch.nn.functional as F
torch.manual_seed(0)
B, H, Hk, D = 1, 32, 2, 128
G = H // Hk
def t(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
for L in (65536, 1 << 20):
    kc = torch.randn(B, L, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(B, L, Hk, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = kc.transpose(1, 2), vc.transpose(1, 2)
    a = lambda: F.scaled_dot_product_attention(q.reshape(B, Hk, G, D), k, v)
    b = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)
    kk, vv = k.contiguous(), v.contiguous()
    c = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)
    ra, rb = a().reshape(B, 1, H, D), b().transpose(1, 2)
    err = ((ra.float() - rb.float()).norm() / rb.float().norm()).item()
    print(f"L={L}: grouped-rows {t(a):.3f} ms, enable_gqa strided {t(b):.3f} ms, enable_gqa contiguous {t(c):.3f} ms, rel diff {err:.2e}", flush=True)
    del kc, vc, kk, vv, k, v
