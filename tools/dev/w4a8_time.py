"""gemm_w4a8 N <= 8 configurations side by side. argv[1]: QUANTCORE_CUDA_TUNE settings separated by
";" ("" for the default). CUDA events around one call queued behind a ~1 ms sleep kernel, 4 weight
sets rotated (4 x 33 MB > L2), median of 50, bf16 activation; every config's output compared with
the first config's (outputs start as NaN): relative difference and bit equality. argv[2] (optional):
shapes as "MxK:n,n,..." separated by spaces (default: SHAPES). Run by tools/dev/w4a8_device.sh and
tools/dev/ab_tree.sh (old against new)."""

import os
import sys

import numpy as np
import torch
from quantcore.backends.cuda import create
from quantcore.backends.cuda.runtime import ENV_TUNE

SHAPES = [(4096, 14336, (1, 2, 4, 8)), (14336, 4096, (1, 2, 4, 8))]


def med(fn, reps: int = 50) -> tuple[float, float, float]:
    """(median, p10, p90) in us of fn(i) behind a sleep kernel."""
    for i in range(5):
        fn(i)
    ts = []
    for i in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda._sleep(1_500_000)
        s.record()
        fn(i)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))


def weights(m: int, k: int, g: torch.Generator) -> list[torch.Tensor]:
    """4 random Q4_0 weight sets [m, k/32, 18] with small positive fp16 scales."""
    wqs = []
    for _ in range(4):
        w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda", generator=g)
        d = (torch.rand(m, k // 32, device="cuda", generator=g) * 0.02 + 0.001).half()
        w[..., 0:2] = d.view(torch.uint8).view(m, k // 32, 2)
        wqs.append(w)
    return wqs


def main() -> None:
    be = create()
    configs = sys.argv[1].split(";") if len(sys.argv) > 1 else [""]
    shapes = SHAPES
    if len(sys.argv) > 2:
        shapes = []
        for spec in sys.argv[2].split():
            mk, ns = spec.split(":")
            m, k = (int(v) for v in mk.split("x"))
            shapes.append((m, k, tuple(int(v) for v in ns.split(","))))
    print("config".ljust(34), "shape".ljust(22), "median us  p10   p90   GB/s(w)  rel.diff  bits==first")
    for m, k, ns in shapes:
        g = torch.Generator(device="cuda")
        g.manual_seed(m)
        wqs = weights(m, k, g)
        for n in ns:
            a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = None
            for cfg in configs:
                os.environ[ENV_TUNE] = cfg
                o = torch.full((m, n), float("nan"), device="cuda")
                be.gemm_w4a8(wqs[0], a, o)
                torch.cuda.synchronize()
                o0 = o.clone()
                if ref is None:
                    ref = o0
                t, p10, p90 = med(lambda i, a=a, o=o, wqs=wqs: be.gemm_w4a8(wqs[i % 4], a, o))
                finite = bool(torch.isfinite(o0).all())
                err = float(((o0 - ref).norm() / ref.norm()).item()) if finite else float("nan")
                same = bool(torch.equal(o0.view(torch.int32), ref.view(torch.int32)))
                gbs = m * k // 32 * 18 / t / 1e3
                print(f"{cfg or 'default':34s} M{m} K{k} N{n}".ljust(58),
                      f"{t:7.1f} {p10:6.1f} {p90:6.1f} {gbs:7.0f}  {err:.1e}  {same}")
    os.environ[ENV_TUNE] = ""


if __name__ == "__main__":
    main()
