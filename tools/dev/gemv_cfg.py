"""gemv_4bit (NF4 bs64 nested, bf16) at the bench's shapes under several QUANTCORE_CUDA_TUNE
settings side by side, each output compared bitwise with the first setting's; torch's bf16 linear
alongside as the drift reference. Timing as gemv_time.py (CUDA events behind a sleep kernel, weight
sets rotated past L2, median of 40). argv[1]: the settings separated by ";" ("" is the default).
Run on the GPU machine from the repository root (PYTHONPATH=.)."""

import os
import pathlib
import sys

import torch
from quantcore.backends import cuda
from quantcore.backends.cuda.runtime import ENV_TUNE

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tools/dev
from gemv_time import SHAPES, med, weight_sets  # noqa: E402


def main() -> None:
    configs = sys.argv[1].split(";") if len(sys.argv) > 1 else [""]
    be = cuda.create()
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    for n, k, b in SHAPES:
        sets = weight_sets(n, k, g)
        a = torch.randn(b, k, dtype=torch.bfloat16, device="cuda", generator=g)
        wb = torch.randn(n, k, dtype=torch.bfloat16, device="cuda", generator=g)
        t_torch = med(lambda i, a=a, wb=wb: torch.nn.functional.linear(a, wb))
        print(f"B{b} {n}x{k}: torch bf16 {t_torch:7.1f} us", flush=True)
        first = None
        for cfg in configs:
            os.environ[ENV_TUNE] = cfg
            out = torch.full((b, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def call(i: int, out=out, a=a, sets=sets, n=n, k=k) -> None:
                packed, qabs, nest = sets[i % len(sets)]
                be.gemv_4bit(a, packed, qabs, out, n=n, k=k, blocksize=64, quant_type="nf4", nested=nest)

            call(0)
            torch.cuda.synchronize()
            res = out.clone()
            same = "first" if first is None else ("bits==" if torch.equal(res.view(torch.int16), first.view(torch.int16))
                                                  else f"DIFF max {float((res.float() - first.float()).abs().max()):.3g}")
            if first is None:
                first = res
            t = med(call)
            print(f"  {cfg or 'default':36s} {t:7.1f} us  {n * k / 2 / t / 1e3:6.0f} GB/s packed  {same}", flush=True)
    os.environ.pop(ENV_TUNE, None)


if __name__ == "__main__":
    main()
