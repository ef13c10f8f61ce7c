"""quantize_4bit configurations side by side (session 7). argv: QUANTCORE_CUDA_TUNE settings, one
per argument, items separated by ";" ("" for the default; e.g. "q4_v=2" "" "q4_stages=6").

Per configuration: the quantize_4bit kernel alone and quantize_4bit with double quantization (the
bench's op, `Backend.quantize_4bit_nested`) at 16384 x 16384 bf16 NF4 blocksize 64 (and the kernel
alone from fp32 input) - CUDA events
around one call queued behind a ~1 ms sleep kernel, median of 40 - and its outputs against the first
configuration's, bit for bit, on that input and on a 515 x 4096 input with NaN / inf / zero blocks in
bf16, fp16 and fp32 for blocksizes 32 to 1024. Run on the GPU machine from the repository root.
"""

from __future__ import annotations

import os
import sys

import torch
from quantcore.backends.cuda.runtime import ENV_TUNE

import quantcore as qc
from quantcore.formats import bnb

sys.path.insert(0, os.path.dirname(__file__))
from bnb4_time import BS, buffers  # noqa: E402
from w4a8_time import med  # noqa: E402


def outputs(be, x: torch.Tensor, bs: int, qt: str) -> list[torch.Tensor]:
    n = x.numel()
    nb = bnb.nblocks(n, bs)
    packed = torch.full(((n + 1) // 2, 1), 0xAB, dtype=torch.uint8, device="cuda")
    absmax = torch.full((nb,), -7.0, dtype=torch.float32, device="cuda")
    be.quantize_4bit(x, packed, absmax, blocksize=bs, quant_type=qt)
    return [packed, absmax.view(torch.int32)]


def special_input(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn((515, 4096), device="cuda", generator=g) * 3
    x[0, :64] = float("nan")
    x[1, 5] = float("nan")
    x[2, 70] = float("inf")
    x[3, 200] = -float("inf")
    x[4, :128] = 0.0
    x[5, 1:300:7] = -0.0
    x[6, :] *= 1e-30
    return x.to(dtype).reshape(-1)[: 515 * 4096 - 37]  # a partial last tile and block


def main() -> None:
    configs = sys.argv[1:] or [""]
    be = qc.get_backend("cuda")
    bs = BS
    x, packed, absmax, q, a2, off = buffers()
    x32 = x.float()
    cases = [(x.reshape(-1), 64, "nf4")] + [
        (special_input(dt), b, qt) for dt in (torch.bfloat16, torch.float16, torch.float32)
        for b in (32, 64, 128, 256, 512, 1024) for qt in ("nf4", "fp4")]
    ref = None
    print(f"device: {torch.cuda.get_device_name()}")
    for cfg in configs:
        os.environ[ENV_TUNE] = cfg.replace(";", ",")
        t_q4 = med(lambda i: be.quantize_4bit(x, packed, absmax, blocksize=bs, quant_type="nf4"), 40)
        t_32 = med(lambda i: be.quantize_4bit(x32, packed, absmax, blocksize=bs, quant_type="nf4"), 20)
        t_nest = med(lambda i: be.quantize_4bit_nested(x, packed, q, a2, off, blocksize=bs, quant_type="nf4"), 40)
        outs = [outputs(be, *case) for case in cases]
        nest = [q.clone(), a2.view(torch.int32).clone(), off.view(torch.int32).clone()]
        if ref is None:
            ref, ref_nest, same = outs, nest, "(reference)"
        else:
            bad = [i for i, (a, b) in enumerate(zip(outs, ref)) if not all(torch.equal(u, v) for u, v in zip(a, b))]
            bad_nest = not all(torch.equal(u, v) for u, v in zip(nest, ref_nest))
            same = "bit-identical" if not bad and not bad_nest else f"DIFFERS: cases {bad}, nested {bad_nest}"
        print(f"{cfg or 'default':28s} q4 {t_q4[0]:7.1f} us [{t_q4[1]:.1f}, {t_q4[2]:.1f}]  "
              f"q4+dq {t_nest[0]:7.1f} us [{t_nest[1]:.1f}, {t_nest[2]:.1f}]  fp32 q4 {t_32[0]:7.1f} us  {same}")
    os.environ[ENV_TUNE] = ""


if __name__ == "__main__":
    main()
