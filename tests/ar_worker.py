"""One rank of the one-shot all-reduce check (tests/test_parallel_cuda.py; started by torchrun on 2+ GPUs).

quantcore.nn.parallel's ``all_reduce="oneshot"`` path against NCCL's all-reduce on the same partial sums:
bf16, fp16 and fp32 tensors of several sizes (one over ONESHOT_MAX_BYTES, which takes NCCL's path),
several rounds in a row (both slots of the buffer), then the same calls captured in a CUDA graph and
replayed with new inputs; then a quantcore gemv's output reduced at once (the all-reduce is a programmatic
dependent of the gemv), eagerly and in a graph; and the fused all-reduce + residual add + RMSNorm. With 2 ranks the sums must be bitwise NCCL's (one fp32 addition, rounded
once); with more, within one rounding of the fp32 sum. With ``--time`` it also times, inside CUDA
graphs of 100 calls each, the three rowwise all-reduces of a decode step's size (8192 bf16 per row).
Writes OUT/ar_rank<r>.json.

    torchrun --standalone --nproc_per_node 2 tests/ar_worker.py OUT [--time]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from quantcore.nn import parallel

SIZES = (8, 8192, 4 * 8192, 28672, parallel.ONESHOT_MAX_BYTES // 2 + 8)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _partial(rank: int, i: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1000 * i + rank)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype).to(device)


def _same(a: torch.Tensor, b: torch.Tensor, world: int) -> bool:
    if world == 2:
        return torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))
    return bool(torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=0))


def main() -> None:
    out_dir, timing = sys.argv[1], "--time" in sys.argv
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    res: dict = {"rank": rank, "world": world, "eager": [], "graph": []}
    i = 0
    for dtype in DTYPES:
        for n in SIZES:
            for _ in range(3):  # rounds in a row: both slots, the flags' round numbers
                i += 1
                x = _partial(rank, i, n, dtype, device)
                ref = x.clone()
                dist.all_reduce(ref, group=group)
                got = parallel._oneshot_all_reduce(x.clone(), group)
                res["eager"].append({"dtype": str(dtype), "n": n, "same": _same(got, ref, world)})
    # a CUDA graph of three calls on static inputs, replayed with new values
    n, dtype = 8192, torch.bfloat16
    static = [torch.empty(n, dtype=dtype, device=device) for _ in range(3)]
    for s in static:
        s.copy_(_partial(rank, 0, n, dtype, device))
        parallel._oneshot_all_reduce(s, group)  # the buffer's rendezvous, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [parallel._oneshot_all_reduce(s, group) for s in static]
    for rep in range(4):
        refs = []
        for j, s in enumerate(static):
            s.copy_(_partial(rank, 10_000 + 10 * rep + j, n, dtype, device))
            r = s.clone()
            dist.all_reduce(r, group=group)
            refs.append(r)
        graph.replay()
        torch.cuda.synchronize()
        res["graph"].append(all(_same(o, r, world) for o, r in zip(outs, refs)))
    res["after_gemv"] = _after_gemv(rank, group, device, world)
    res["fused_norm"] = _fused_norm(rank, group, device, world)
    if timing:
        res["time_us"] = _time(group, device)
    with open(os.path.join(out_dir, f"ar_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()


def _after_gemv(rank: int, group, device, world: int) -> list[bool]:
    """The rowwise pattern of decode: a quantcore gemv (which lets its dependents launch early) writes the
    partial sums that the one-shot all-reduce then reads (launched as a programmatic dependent: it must
    wait for the gemv), eagerly and in a CUDA graph replayed with new inputs."""
    from quantcore import nn as qnn

    g = torch.Generator(device="cpu").manual_seed(77 + rank)
    lin = torch.nn.Linear(4096, 8192, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8192, 4096, generator=g) * 0.02)
    q = qnn.Linear4bit.from_linear(lin.to(device))
    x = torch.empty(1, 4096, dtype=torch.bfloat16, device=device)

    def step():
        return parallel._oneshot_all_reduce(q(x), group)

    def check(out) -> bool:
        ref = q(x)
        dist.all_reduce(ref, group=group)
        return _same(out, ref, world)

    ok = []
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=g).to(torch.bfloat16))
        ok.append(check(step()))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=g).to(torch.bfloat16))
        graph.replay()
        ok.append(check(out))
    return ok


def _fused_norm(rank: int, group, device, world: int) -> list[dict]:
    """all_reduce_add_rms_norm's one kernel against NCCL's sum, then torch's add and RMSNorm: the new
    residual bit for bit (two ranks), the normed output within two roundings (the mean's order and rsqrt
    are the kernel's own); rows 1, 4 and 3 (of 5120), three dtypes, between plain one-shot rounds on the same buffer,
    eagerly and in a CUDA graph."""
    out = []
    tol = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9, torch.float32: 1e-5}
    for dtype in DTYPES:
        for rows, n in ((1, 8192), (4, 8192), (3, 5120)):  # 5120: a row's units not a multiple of the CTA's threads
            g = torch.Generator(device="cpu").manual_seed(500 + rows + rank)
            part = (torch.randn(rows, n, generator=g) * (1 + rank)).to(dtype).to(device)
            resid = torch.randn(rows, n, generator=torch.Generator().manual_seed(9 + rows)).to(dtype).to(device)
            w = (torch.rand(n, generator=torch.Generator().manual_seed(8)) + 0.5).to(dtype).to(device)
            y = part.clone()
            dist.all_reduce(y, group=group)
            h_ref = resid + y
            h32 = h_ref.float()
            n_ref = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
            parallel._oneshot_all_reduce(part.clone(), group)  # a plain round on the same buffer first
            h, normed = parallel.all_reduce_add_rms_norm(part, resid, w, 1e-5, group)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                hg, ng = parallel.all_reduce_add_rms_norm(part, resid, w, 1e-5, group)
            graph.replay()
            torch.cuda.synchronize()
            out.append({"dtype": str(dtype), "rows": rows, "n": n,
                        "h_same": _same(h, h_ref, world) and _same(hg, h_ref, world),
                        "norm_close": bool(torch.allclose(normed.float(), n_ref.float(), rtol=tol[dtype], atol=1e-6)
                                           and torch.equal(ng, normed))})
    return out


def _time(group, device) -> dict:
    """us per all-reduce of one decode row (8192 bf16), each way, inside a CUDA graph of 100 calls."""
    import torch.distributed._symmetric_memory as symm_mem  # noqa: F401 - symm_mem's ops

    x = torch.randn(8192, device=device).to(torch.bfloat16)
    r, w = torch.randn(1, 8192, device=device).to(torch.bfloat16), torch.ones(8192, device=device, dtype=torch.bfloat16)
    ways = {"nccl": lambda: dist.all_reduce(x, group=group),
            "symm_mem": lambda: parallel._symm_mem_all_reduce(x, group),
            "oneshot": lambda: parallel._oneshot_all_reduce(x, group),
            "oneshot_add_rms_norm": lambda: parallel.all_reduce_add_rms_norm(x.view(1, -1), r, w, 1e-5, group)}
    out = {}
    for name, fn in ways.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(100):
                fn()
        g.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) * 1e3 / 100)
        out[name] = best
    return out


if __name__ == "__main__":
    main()
