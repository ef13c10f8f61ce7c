"""Which op makes a decode step of tools/tp_decode.py's stack give other bits when repeated?

Builds the stack at TP=1 (Llama-3-70B widths, ``LAYERS`` layers, nf4), runs the step three times
(a stray allocation between the first two, to move the caching allocator's addresses) and records
every op's inputs and output (the linears, attention, the compiled or plain glue); prints, per
setting, the first op whose output differs while its inputs were bitwise equal. Settings: each
attention backend of ``tp_decode.ATTENTION`` and, last, quantcore's eager launch plans off.
Session 15 found cuDNN attention this way (docs/parallel.md).

    LAYERS=80 python tools/dev/tp_repeat_diag.py                      # one GPU
    QUANTCORE_CUDA_TUNE=pdl=0 ONLY_FIRST=1 python tools/dev/tp_repeat_diag.py
    DEVICE=cpu LAYERS=2 python tools/dev/tp_repeat_diag.py            # the logic, small widths
"""

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import tp_decode as T  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

import quantcore.api as qapi  # noqa: E402

CPU = os.environ.get("DEVICE") == "cpu"
L = int(os.environ.get("LAYERS", "80"))
a = T.parse(["--device", "cpu" if CPU else "cuda", "--layers", str(L), "--out", os.devnull]
            + (["--hidden", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2", "--ctx", "16"]
               if CPU else []))
if CPU:
    dev, dt = torch.device("cpu"), torch.float32
else:
    torch.cuda.set_device(0)
    dev, dt = torch.device("cuda", 0), torch.bfloat16


def sync():
    if not CPU:
        torch.cuda.synchronize()


if os.environ.get("COMPILE_GLUE") == "1":
    for name, fn in list(T.GLUE.items()):
        T.GLUE[name] = torch.compile(fn, fullgraph=True, dynamic=False)
t0 = time.time()
layers = T.build(a, 0, 1, dt, dev)
print(f"built {L} layers in {time.time() - t0:.0f} s", flush=True)
x, caches, pos, inv = T.inputs(a, 0, 1, dt, dev)

REC = None  # while recording: [(op name, input copies, output copy)]


def rec(name, inputs, out):
    if REC is not None:
        outs = out if isinstance(out, tuple) else (out,)
        REC.append((name, [t.detach().clone() for t in inputs if torch.is_tensor(t)],
                    [t.detach().clone() for t in outs]))


for i, layer in enumerate(layers):
    for part in ("self_attn", "mlp"):
        for child, m in getattr(layer, part).named_children():
            m.register_forward_hook(lambda mod, inp, out, nm=f"{i}.{child}": rec(nm, inp, out))
_sdpa = T.F.scaled_dot_product_attention


def sdpa(q, k, v, **kw):
    o = _sdpa(q, k, v, **kw)
    rec("scaled_dot_product_attention", (q, k, v), o)
    return o


T.F.scaled_dot_product_attention = sdpa
for name in list(T.GLUE):
    def wrap(*args, f0=T.GLUE[name], name=name):
        o = f0(*args)
        rec(name, args, o)
        return o
    T.GLUE[name] = wrap


def step():
    h, r = T.forward(layers, caches, x, pos, inv, dt)
    return h + r


def recorded():
    global REC
    REC = []
    with torch.inference_mode():
        out = step()
    sync()
    r, REC = REC, None
    return out, r


def compare(ra, rb):
    for (na, ia, oa), (_, ib, ob) in zip(ra, rb):
        same_in = all(torch.equal(p, q) for p, q in zip(ia, ib))
        for p, q in zip(oa, ob):
            if not torch.equal(p, q):
                d = float((p.double() - q.double()).norm() / q.double().norm())
                return f"first differing output: {na} (inputs {'equal' if same_in else 'differ'}), rel. L2 {d:.2e}"
    return "all equal"


def run(tag, ctx=None):
    with ctx or contextlib.nullcontext():
        with torch.inference_mode():
            for _ in range(3):
                step()
        sync()
        oa, ra = recorded()
        junk = torch.empty(12345, device=dev)  # moves the next step's allocations
        ob, rb = recorded()
        del junk
        oc, rc = recorded()
    print(f"{tag}: step 1 vs 2: {compare(ra, rb)} | step 2 vs 3: {compare(rb, rc)} | outputs equal: "
          f"{torch.equal(oa, ob)}, {torch.equal(ob, oc)}", flush=True)


for name, backends in T.ATTENTION.items():
    try:
        run(f"attention={name}", sdpa_kernel(backends))
    except RuntimeError as exc:  # a backend that cannot run this step (CPU: cudnn)
        print(f"attention={name}: {str(exc)[:160]}")
    if os.environ.get("ONLY_FIRST") == "1":
        sys.exit(0)
qapi.EAGER_PLANS = False
for layer in layers:
    for part in ("self_attn", "mlp"):
        for m in getattr(layer, part).children():
            m.__dict__.pop("_bound", None)
try:
    run("attention=cudnn, no eager launch plans", sdpa_kernel(T.ATTENTION["cudnn"]))
except RuntimeError as exc:
    print(f"attention=cudnn, no eager launch plans: {str(exc)[:160]}")
