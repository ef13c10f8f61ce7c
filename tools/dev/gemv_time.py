"""gemv_4bit (streaming kernel, NF4 bs64 nested, bf16) at the bench's shapes, with its timing
variants side by side: DBG 0 (the kernel), 1 (no table load in the decode), 2 (no copies: compute
and shared-memory work only), 3 (no mma groups: the copies, scales and bookkeeping only), 4 (no
mma: two XORs per mma keep the decode live). torch's bf16 linear alongside as the drift
reference. CUDA events around one call behind a sleep kernel, weight sets rotated past L2, median
of 40. argv[1] (optional): the variants, comma separated ("0,1,2,3,4"). Run on the GPU machine from the repository root (PYTHONPATH=.)."""

import pathlib
import sys

import torch
from quantcore.backends import cuda

from quantcore.backend import Nested
from quantcore.formats import bnb

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tools/dev: w4a8_time
from w4a8_time import med as w4a8_med  # noqa: E402

SHAPES = [(16384, 16384, 1), (14336, 4096, 1), (16384, 16384, 8)]


def med(fn) -> float:
    """Median us of fn(i) behind a sleep kernel (w4a8_time's timing)."""
    return w4a8_med(fn, 40)[0]


def weight_sets(n: int, k: int, g: torch.Generator) -> list[tuple]:
    nsets = max(2, -(-200_000_000 // (n * k // 2)))
    code2 = torch.tensor(bnb.DYNAMIC_MAP, dtype=torch.float32, device="cuda")
    sets = []
    for _ in range(nsets):
        packed = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device="cuda", generator=g)
        nb = n * k // 64
        qabs = torch.randint(0, 256, (nb,), dtype=torch.uint8, device="cuda", generator=g)
        abs2 = torch.rand((nb + 255) // 256, device="cuda", generator=g) * 0.1 + 0.01
        off = torch.full((1,), 0.05, dtype=torch.float32, device="cuda")
        sets.append((packed, qabs, Nested(absmax2=abs2, code2=code2, offset=off)))
    return sets


def time_shape(be, n: int, k: int, b: int, g: torch.Generator, variants: list[int]) -> str:
    """One line: torch's bf16 linear and each variant of the streaming kernel at [b, k] x [n, k]^T."""
    real = cuda._gemv_stream
    sets = weight_sets(n, k, g)
    a = torch.randn(b, k, dtype=torch.bfloat16, device="cuda", generator=g)
    out = torch.empty(b, n, dtype=torch.bfloat16, device="cuda")
    wb = torch.randn(n, k, dtype=torch.bfloat16, device="cuda", generator=g)
    line = [f"B{b} {n}x{k}: torch bf16 {med(lambda i: torch.nn.functional.linear(a, wb)):7.1f} us"]

    def call(i: int) -> None:
        packed, qabs, nest = sets[i % len(sets)]
        be.gemv_4bit(a, packed, qabs, out, n=n, k=k, blocksize=64, quant_type="nf4", nested=nest)

    try:
        for dbg in variants:
            cuda._gemv_stream = lambda tag, qt, nested, v, dbg=dbg: real(tag, qt, nested, v)[:-1] + f", {dbg}>"
            t = med(call)
            line.append(f"DBG{dbg} {t:7.1f} us ({n * k / 2 / t / 1e3:6.0f} GB/s packed)")
    finally:
        cuda._gemv_stream = real
    return " | ".join(line)


def main() -> None:
    variants = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "0,1,2,3,4").split(",")]
    be = cuda.create()
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    for n, k, b in SHAPES:
        print(time_shape(be, n, k, b, g, variants), flush=True)


if __name__ == "__main__":
    main()
