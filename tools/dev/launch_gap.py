"""What a launch with a large CTA costs between torch's small kernels inside a CUDA graph (device machine).

A decode step interleaves quantcore's gemv launches (one CTA per SM, 512 threads, ~227 KB of dynamic shared
memory) with torch's / inductor's small kernels. This replays CUDA graphs of REPS pairs [torch's x.add_(1) on
a 4096-element bf16 vector, K] and prints the time per pair, for K:
- nothing (the torch kernel alone), and an empty kernel (it returns at once) of 132 / 264 CTAs x 512 threads
  with 0, 48, 100, 160 and 227 KB of dynamic shared memory, launched plainly and as a programmatic dependent;
- the real gemv_4bit (NF4, blocksize 64, nested, batch 1, bf16) at 1024x4096, 4096x4096 and 14336x4096, and the
  same launches back to back (no torch kernel between them); torch's bf16 F.linear likewise.

    python3 tools/dev/launch_gap.py [--reps 200]

The empty kernels are compiled here by CuPy; the gemv through quantcore's backend (quantcore.nn.Linear4bit, as in a model).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import cupy as cp
import torch
from quantcore.backends.cuda import runtime as rt

import quantcore.nn as qnn
from quantcore.bench import capture_graph, replay_us, trace_kernels

SRC = r"""
extern "C" __global__ void qc_empty(int* p) {
    extern __shared__ int s[];
    if (p != nullptr && threadIdx.x == 0) p[blockIdx.x] = s[0];
}
"""


def graph_time(body, reps: int, replays: int = 20, profile_name: str | None = None) -> float:
    """us per body() call: a CUDA graph of reps calls, replayed, median of replays; with profile_name, also
    the median duration of the kernels whose name has it and the gaps before / after them (one replay)."""

    def many():
        for _ in range(reps):
            body()

    g = capture_graph(many)
    if profile_name is not None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        kern = [k for k in trace_kernels(prof) if not k[2].startswith(("Memset", "Memcpy"))]
        durs = [d for _, d, nm in kern if profile_name in nm]
        gaps = [
            kern[i][0] - kern[i - 1][0] - kern[i - 1][1]
            for i in range(1, len(kern))
            if profile_name in kern[i][2]
        ]
        after = [
            kern[i + 1][0] - kern[i][0] - kern[i][1]
            for i in range(len(kern) - 1)
            if profile_name in kern[i][2]
        ]
        print(
            f"    profile '{profile_name}': duration {statistics.median(durs):6.2f} us, gap before "
            f"{statistics.median(gaps) if gaps else float('nan'):5.2f}, after {statistics.median(after):5.2f} (medians)"
        )
    return statistics.median(replay_us(g, replays)) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--no-empty", action="store_true", help="skip the empty kernels")
    args = p.parse_args()
    dev = torch.device("cuda")
    x = torch.zeros(4096, device=dev, dtype=torch.bfloat16)
    mod = cp.RawModule(code=SRC)
    kern = mod.get_function("qc_empty")
    kern.max_dynamic_shared_size_bytes = 227 * 1024
    fn = kern.ptr if hasattr(kern, "ptr") else kern.kernel.ptr
    rt.pdl_available()
    params = (ctypes.c_void_p * 1)()
    nullp = ctypes.c_void_p(0)
    params[0] = ctypes.cast(ctypes.pointer(nullp), ctypes.c_void_p)

    def empty(grid: int, smem: int, pdl: bool):
        def go():
            stream = torch.cuda.current_stream().cuda_stream
            if pdl:
                rt.launch_pdl(fn, (grid, 1, 1), 512, smem, stream, ctypes.addressof(params))
            else:
                with cp.cuda.ExternalStream(stream):
                    kern((grid,), (512,), (0,), shared_mem=smem)

        return go

    print(torch.cuda.get_device_name(), f"{args.reps} pairs a graph, us per pair")
    base = graph_time(lambda: x.add_(1), args.reps)
    print(f"{'torch add_ alone':48s} {base:7.2f}")
    for grid in () if args.no_empty else (132, 264):
        for kb in (0, 48, 100, 160, 227):
            for pdl in (False, True):
                k = empty(grid, kb * 1024, pdl)
                t = graph_time(lambda k=k: (x.add_(1), k()), args.reps)
                t2 = graph_time(k, args.reps)
                print(
                    f"add_ + empty {grid} CTAs {kb:3d} KB {'pdl' if pdl else 'plain':5s}        {t:7.2f} "
                    f"(+{t - base:5.2f}; empty alone back to back {t2:6.2f})"
                )
    for n, k in ((1024, 4096), (4096, 4096), (14336, 4096)):
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        mod4 = qnn.Linear4bit.from_linear(lin, "nf4", 64, True, torch.bfloat16)
        a = torch.randn(1, 1, k, device=dev, dtype=torch.bfloat16)

        def gemv(a=a, m=mod4):
            m(a)

        t = graph_time(lambda g=gemv: (x.add_(1), g()), args.reps, profile_name="gemv_4bit")
        t2 = graph_time(gemv, args.reps, profile_name="gemv_4bit")
        print(f"add_ + Linear4bit {n}x{k}                {t:7.2f} (+{t - base:5.2f}; back to back {t2:6.2f})")
        wl = lin.weight
        t = graph_time(
            lambda a=a, wl=wl: (x.add_(1), torch.nn.functional.linear(a, wl)), args.reps, profile_name="nvjet"
        )
        t2 = graph_time(lambda a=a, wl=wl: torch.nn.functional.linear(a, wl), args.reps, profile_name="nvjet")
        print(f"add_ + F.linear bf16 {n}x{k}             {t:7.2f} (+{t - base:5.2f}; back to back {t2:6.2f})")


if __name__ == "__main__":
    main()
