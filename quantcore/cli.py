"""The ``quantcore`` command line: info, demo, check, bench, quantize."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

from . import __version__, api, registry
from .errors import QuantcoreError
from .formats import GGUF_FORMATS, QUANTIZE_FORMATS


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# -- info --------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    from .ops import ALL_CAPABILITIES

    print(f"quantcore {__version__}   default backend: {registry.DEFAULT_BACKEND}"
          f"   selected: {_selected_name()}")
    rows = []
    for name, avail in registry.available_backends().items():
        devices, caps = "", ""
        if avail:
            be = registry.get_backend(name)
            devices = ", ".join(be.devices())
            caps = f"{len(be.capabilities() & ALL_CAPABILITIES)}/{len(ALL_CAPABILITIES)}"
        status = ("available" + (f" ({avail.mode})" if avail.mode else "")) if avail else "unavailable"
        rows.append([name, status, devices or "-", caps or "-", "" if avail else avail.reason])
    print(_table(rows, ["backend", "status", "devices", "ops covered", "why not"]))
    return 0


def _selected_name() -> str:
    import os

    return (getattr(registry._current, "name", None) or registry._global_name[0]
            or os.environ.get(registry.ENV_VAR) or registry.DEFAULT_BACKEND)


# -- demo --------------------------------------------------------------------------------------
def _timed(be, fn: Callable[[], object]) -> tuple[object, float]:
    fn()  # warm-up: kernel builds and first-touch stay out of the timing
    be.synchronize()
    t0 = time.perf_counter()
    out = fn()
    be.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _demo_backend(name: str, n: int, k: int, seed: int) -> list[list[str]]:
    be = registry.get_backend(name)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    a = rng.standard_normal((4, k)).astype(np.float32)
    dev = lambda x: be.finish(be.from_numpy(x), None)  # noqa: E731
    host = lambda x: be.to_numpy(be.prepare(x)).astype(np.float64)  # noqa: E731
    wd, ad = dev(w), dev(a[:1])
    rows = []
    (packed, state), t_q = _timed(be, lambda: api.quantize_4bit(wd, 64, "nf4", True, backend=be))
    deq, t_d = _timed(be, lambda: api.dequantize_4bit(packed, state, backend=be))
    wdeq = host(deq)
    rows.append([name, "quantize_4bit nf4+dq", f"{n}x{k}", f"{t_q:.2f}", "-"])
    rows.append([name, "dequantize_4bit", f"{n}x{k}", f"{t_d:.2f}", f"{_rel_err(wdeq, w):.2e} (vs original)"])
    y, t_g = _timed(be, lambda: api.gemv_4bit(ad, packed, state, backend=be))
    rows.append([name, "gemv_4bit", f"1x{k} @ {n}x{k}", f"{t_g:.3f}",
                 f"{_rel_err(host(y), a[:1].astype(np.float64) @ wdeq.T):.2e} (vs fp64)"])
    wq, t_q4 = _timed(be, lambda: api.quantize_q4_0(wd, backend=be))
    a4 = dev(a)
    y8, t_w = _timed(be, lambda: api.gemm_w4a8(wq, a4, n, 4, k, backend=be))
    rows.append([name, "quantize_q4_0", f"{n}x{k}", f"{t_q4:.2f}", "-"])
    ref = w.astype(np.float64) @ a.astype(np.float64).T
    rows.append([name, "gemm_w4a8 (Q8_1 on the fly)", f"{n}x{k} x 4", f"{t_w:.3f}",
                 f"{_rel_err(host(y8), ref):.2e} (vs fp64 original)"])
    return rows


def cmd_demo(args: argparse.Namespace) -> int:
    names = [args.backend] if args.backend else [n for n, a in registry.available_backends().items() if a]
    print(f"quantcore {__version__} demo: NF4 + double quantization, gemv, W4A8 on "
          f"{args.rows}x{args.cols} (seed {args.seed})")
    rows: list[list[str]] = []
    for name in names:
        try:
            rows += _demo_backend(name, args.rows, args.cols, args.seed)
        except QuantcoreError as exc:
            rows.append([name, "(failed)", "-", "-", str(exc)])
    print(_table(rows, ["backend", "op", "shape", "ms", "relative L2 error"]))
    print("errors: 4-bit weights keep ~9-10% relative error by design (NF4); gemv and W4A8 against fp64.")
    return 1 if any(r[1] == "(failed)" for r in rows) else 0


# -- quantize ----------------------------------------------------------------------------------
def cmd_quantize(args: argparse.Namespace) -> int:
    from .convert import quantize_checkpoint

    quantize_checkpoint(args.input, args.output, args.format, blocksize=args.blocksize, backend=args.backend,
                        skip=args.skip, max_shard_size=args.max_shard_size, force=args.force, pure=args.pure,
                        progress=not args.quiet, min_numel=args.min_numel, allow_requantize=args.allow_requantize,
                        workers=args.workers, devices=args.devices)
    return 0


def _quantize_failure(exc: BaseException) -> str:
    """The one line a failed ``quantcore quantize`` prints (after ``quantcore: error: ``)."""
    import errno

    from .io.atomic import describe_os_error

    if isinstance(exc, KeyboardInterrupt):
        return "interrupted; the previous output (if any) is untouched and no temporary files are left"
    if isinstance(exc, OSError):
        where = exc.filename or "the output"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return describe_os_error(exc, where)
        return f"{describe_os_error(exc, where)}; the previous output (if any) is untouched"
    if isinstance(exc, QuantcoreError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _one_line_usage_error(message: str):
    """argparse's error for ``quantize``: one line, exit status 2, as every other failure."""
    print(f"quantcore: error: {message} (quantcore quantize --help)", file=sys.stderr)
    raise SystemExit(2)


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        return _delegate("quantcore.conformance", argv[1:])
    if argv and argv[0] == "bench":
        return _delegate("quantcore.bench", argv[1:])
    p = argparse.ArgumentParser(prog="quantcore", description=__doc__)
    p.add_argument("--version", action="version", version=f"quantcore {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="backends, devices, and why some are unavailable")
    d = sub.add_parser("demo", help="quantize, dequantize, gemv and W4A8 on every available backend")
    d.add_argument("--backend", help="only this backend")
    d.add_argument("--rows", type=int, default=2048)
    d.add_argument("--cols", type=int, default=2048)
    d.add_argument("--seed", type=int, default=0)
    sub.add_parser("check", help="the conformance suite (quantcore check --help)")
    sub.add_parser("bench", help="speed table against the peers (quantcore bench --help)")
    q = sub.add_parser("quantize", help="quantize a model folder, a safetensors file or a GGUF file",
                       description="Quantize a checkpoint into a layout its ecosystem's loaders read "
                                   "(docs/checkpoints.md).")
    q.add_argument("input", help="a transformers model folder, a .safetensors file, or a .gguf file")
    q.add_argument("-o", "--output", required=True, help="the folder / file to write (never an input)")
    q.add_argument("--format", required=True, choices=list(QUANTIZE_FORMATS),
                   help="nf4/fp4: bitsandbytes; nvfp4: compressed-tensors; mxfp4: gpt-oss; "
                        f"{'/'.join(GGUF_FORMATS)}: GGUF input only")
    q.add_argument("--blocksize", type=int, default=64, help="4-bit block size (nf4/fp4)")
    q.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="keep these linear layers in float too (repeatable; a module name, a run of its "
                        "dotted parts, a regex or a glob)")
    q.add_argument("--max-shard-size", default="5GB", help="largest output shard of a folder (default 5GB)")
    q.add_argument("--force", action="store_true", help="replace an existing output")
    q.add_argument("--pure", action="store_true", help="GGUF: every 2-D tensor in --format (llama-quantize --pure)")
    q.add_argument("--workers", type=int, default=1,
                   help="processes that quantize tensors in parallel (the output is byte-identical to one process)")
    q.add_argument("--devices", default=None,
                   help="GPUs to spread the tensors over, e.g. cuda:0,cuda:1 (two worker threads each, in this process, "
                        "or --workers in all if more; implies --backend cuda unless given)")
    q.add_argument("--allow-requantize", action="store_true",
                   help="GGUF: accept Q4_0 / Q8_0 input tensors, dequantized first (llama-quantize --allow-requantize)")
    q.add_argument("--backend", default=None, help="quantize on this backend (default $QUANTCORE_BACKEND, else cpu)")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    q.add_argument("--min-numel", type=int, default=4096,
                   help="a single .safetensors input: 2-D tensors with fewer elements stay unquantized")
    q.error = _one_line_usage_error  # type: ignore[method-assign]
    args = p.parse_args(argv)
    try:
        if args.cmd == "info":
            return cmd_info(args)
        if args.cmd == "demo":
            return cmd_demo(args)
    except QuantcoreError as exc:
        print(f"quantcore: error: {exc}", file=sys.stderr)
        return 2
    try:
        return cmd_quantize(args)
    except (Exception, KeyboardInterrupt) as exc:  # every failure: one line and exit status 2
        print(f"quantcore: error: {_quantize_failure(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
