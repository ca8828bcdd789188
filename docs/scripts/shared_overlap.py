"""Graph-replay time of a DeepSeek-V3-like layer (32 local experts of 256, H 7168, I 2048, top-8, shared 2048)
with the shared experts on a second stream (`Vendor.overlap`) and inline (docs/performance.md).

Run on a CUDA machine from the repository root: `python docs/scripts/shared_overlap.py`. The inline
layer's vendor has its `overlap` replaced by the default one, for this comparison only.
"""

import torch

import moe
from hal import VendorOps
from vendors.cuda import CudaVendor


def layer(vendor):
    g = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, S = 32, 7168, 2048, 2048
    l = moe.MoELayer(H, I, E, 8, vendor=vendor, shared_experts=moe.SharedExperts(S))
    l.load_weights(
        torch.randn(E, H, 2 * I, device="cuda", generator=g, dtype=torch.bfloat16) / 85,
        torch.randn(E, I, H, device="cuda", generator=g, dtype=torch.bfloat16) / 45,
    )
    l.load_shared_experts(
        torch.randn(H, 2 * S, device="cuda", generator=g, dtype=torch.bfloat16) / 85,
        torch.randn(S, H, device="cuda", generator=g, dtype=torch.bfloat16) / 45,
    )
    return l


def graph_us(l, tokens):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16, generator=g)
    lg = torch.randn(tokens, 32, device="cuda", generator=g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            l(x, lg)
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        y = l(x, lg)
    ts = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[15], y.clone()


on = CudaVendor()
off = CudaVendor()
off.ops.overlap = VendorOps.overlap.__get__(off.ops)  # inline, for comparison only
lon, loff = layer(on), layer(off)
print("tokens  overlap_us  inline_us  ratio  equal")
for t in (1, 8, 64, 512, 2048):
    a, ya = graph_us(lon, t)
    b, yb = graph_us(loff, t)
    print(f"{t:6d} {a:11.1f} {b:10.1f} {b / a:6.3f}  {torch.equal(ya, yb)}")
