"""NF4 linear for 256..4096 rows: does dequantizing the weight a panel of rows at a time into a buffer
that stays in L2, each panel multiplied by cuBLAS right after, beat the path `linear_4bit` takes
today (the whole weight dequantized to a new bf16 tensor, then one F.linear)? A measurement for
issue 20 item 2, not a code path: nothing in the package uses panels for NF4 yet.

Per shape (N x K, NF4 bs 64 nested, bf16) and row count it times, in one process (CUDA events behind
a sleep kernel, median, 3 rotating weights as quantcore.bench does):
- torch bf16 F.linear;
- today's path: dequantize_4bit (new tensor) + F.linear;
- the same with the dequantized weight written into a preallocated buffer (allocation left out);
- panels of P row blocks (P = 2, 4, 8, 16): for each panel, the kernel-level dequantize of its rows
  (a slice of the packed codes, of the absmax codes and of absmax2: panels start on 256-block
  groups) into one reused buffer, then torch.mm(panel, x^T, out=y^T[rows of the panel]) - the
  output is y^T (N x rows); a real path would need its transpose or a cuBLAS call writing y's
  column block (ldc), not timed here;
- the panel path's parts alone: the P dequantizes, the P matmuls.
Each panel output is compared with the whole path's (relative difference of y^T against y^T of
dequantize + F.linear: the sums run in another order inside cuBLAS, so not bit-equal).

Usage (GPU machine, repository root): python3 tools/dev/nf4_panel_time.py [--rows 256,512,2048]
"""

from __future__ import annotations

import sys

import torch
from gemm4_time import events_us  # this folder: the NF4 many-rows timer (quantcore.bench's)
from quantcore.backends.cuda import plans as cuda_plans

import quantcore as qc
from quantcore.backend import Nested

SHAPES = ((14336, 4096), (4096, 14336))
ROWS = (256, 512, 1024, 2048, 4096)
PANELS = (2, 4, 8, 16)


def panel_parts(p, s, n: int, k: int, parts: int):
    """(packed, absmax, nested) slices of each of `parts` row panels, or None where a panel would not
    start on a 256-block group of absmax2."""
    nested = cuda_plans._state_nested(s)
    rows = n // parts
    if n % parts or (rows * k // 64) % 256:
        return None
    out = []
    for i in range(parts):
        r0, r1 = i * rows, (i + 1) * rows
        b0, b1 = r0 * k // 64, r1 * k // 64
        pn = Nested(absmax2=nested.absmax2[b0 // 256: b1 // 256], code2=nested.code2, offset=nested.offset)
        out.append((p.view(-1)[r0 * k // 2: r1 * k // 2], s.absmax[b0:b1], pn, r0, r1))
    return out


def main() -> None:
    rows_list = ROWS
    if "--rows" in sys.argv:
        rows_list = tuple(int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(","))
    be = qc.get_backend("cuda")
    lin = torch.nn.functional.linear
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    for n, k in SHAPES:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(3)]
        qs = [qc.quantize_4bit(w, 64, "nf4", True, backend=be) for w in ws]
        wbuf = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)

        def dq_into(p, s, out):
            be.dequantize_4bit(p, s.absmax, out.view(-1), blocksize=64, quant_type="nf4", nested=cuda_plans._state_nested(s))

        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            yt = torch.empty(n, rows, device="cuda", dtype=torch.bfloat16)
            t_torch = events_us([lambda w=w, x=x: lin(x, w) for w in ws])
            t_path = events_us([lambda p=p, s=s, x=x: lin(x, qc.dequantize_4bit(p, s, backend=be)) for p, s in qs])
            t_buf = events_us([lambda p=p, s=s, x=x, wb=wbuf: (dq_into(p, s, wb), lin(x, wb)) for p, s in qs])
            p0, s0 = qs[0]
            ref = lin(x, qc.dequantize_4bit(p0, s0, backend=be)).t().float()
            line = (f"N{n} K{k} rows{rows:5d}: torch {t_torch:7.1f} us | dq+mm {t_path:7.1f} ({t_torch / t_path:.2f}x)"
                    f" | dq into buffer + mm {t_buf:7.1f} ({t_torch / t_buf:.2f}x)")
            for parts in PANELS:
                plist = [panel_parts(p, s, n, k, parts) for p, s in qs]
                if plist[0] is None:
                    continue
                pr = n // parts
                pbuf = torch.empty(pr, k, device="cuda", dtype=torch.bfloat16)

                def run(pl, x=x, pbuf=pbuf, yt=yt):
                    for pp, am, nest, r0, r1 in pl:
                        be.dequantize_4bit(pp, am, pbuf.view(-1), blocksize=64, quant_type="nf4", nested=nest)
                        torch.mm(pbuf, x.t(), out=yt[r0:r1])

                def dq_only(pl, pbuf=pbuf):
                    for pp, am, nest, _, _ in pl:
                        be.dequantize_4bit(pp, am, pbuf.view(-1), blocksize=64, quant_type="nf4", nested=nest)

                def mm_only(pl, x=x, pbuf=pbuf, yt=yt):
                    for _, _, _, r0, r1 in pl:
                        torch.mm(pbuf, x.t(), out=yt[r0:r1])

                run(plist[0])
                torch.cuda.synchronize()
                d = float((yt.float() - ref).norm() / ref.norm())
                t_p = events_us([lambda pl=pl: run(pl) for pl in plist])
                t_d = events_us([lambda pl=pl: dq_only(pl) for pl in plist])
                t_m = events_us([lambda pl=pl: mm_only(pl) for pl in plist])
                line += (f" | P{parts} ({pr * k * 2 / 2**20:.0f} MiB) {t_p:7.1f} ({t_torch / t_p:.2f}x; dq {t_d:.1f} + mm"
                         f" {t_m:.1f}; rel.diff {d:.1e})")
            print(line, flush=True)
        del ws, qs, wbuf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
