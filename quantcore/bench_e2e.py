"""``quantcore bench --e2e``: end-to-end speed and memory of a Llama-3-8B-shaped model, per weight format.

One process builds, for each variant in turn, a transformers ``LlamaForCausalLM`` of Llama-3-8B's shape
(hidden 4096, intermediate 14336, 32 heads, 8 kv heads, vocab 128256, 32 layers; ``--layers N`` keeps
the first N, ``--preset tiny`` is a micro model for tests) with random bf16 weights, times it, frees it
and goes on. Variants: ``bf16`` (torch), ``bnb-nf4`` (bitsandbytes ``Linear4bit``, nf4 + double quant,
blocksize 64), ``qc-nf4`` / ``qc-q4_0`` / ``qc-mxfp4`` (``quantcore.nn.quantize_model``); lm_head stays
bf16 in every variant. A variant (or one measurement of it) that fails is recorded with its error text
and the others go on. The JSON is rewritten after every variant, so a run that is cut off keeps what
it measured; ``--merge`` adds earlier variants from the same JSON (same model, settings and device) so a
full run can be split over several calls.

Method: weights are drawn once per variant with the same seed (``normal_(std=0.02)`` on the device, so
every variant quantizes the same bf16 model); greedy decoding (argmax fed back, no host sync inside the
timed loop) over transformers' ``StaticCache`` sized prompt + new tokens, driven by a hand-written loop:
a prompt of ``--prompt-len`` random tokens is prefilled eagerly (not timed), then ``--new-tokens``
decode steps are timed together between two CUDA events (``decode tok/s`` = batch x steps / time; host
overhead included, as a user sees it). ``eager`` calls the model; ``compiled`` calls
``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)`` (CUDA graphs),
compiled afresh per batch size; ``--warmup`` untimed decode runs (compilation and graph capture included)
come first, then the median of ``--reps`` timed runs. ``prefill tok/s``: one eager forward of
``--prefill-len`` tokens at batch 1 (no cache, logits of the last position), median of ``--reps`` after
``--warmup`` untimed calls. Memory: ``torch.cuda.max_memory_allocated`` over building (+ quantizing) the
variant, ``memory_allocated`` once built, and the peak over the timed runs (caches, CUDA-graph pools and
activations included); ``linear bytes``: parameters, buffers and quantization-state tensors of the
modules in the decoder's nn.Linear positions (lm_head counted apart). On ``--device cpu`` (the tests) the
host clock replaces the events and no memory is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import signal
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from . import __version__
from .bench import table_lines

#: model shapes; ``llama3-8b`` is Meta-Llama-3-8B's config (rope theta 500000, untied lm_head)
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, num_hidden_layers=32, rms_norm_eps=1e-5, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=1024,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
#: variant -> quantcore.nn format (the qc-* ones); bf16 and bnb-* are built here
QC_FORMATS = {"qc-nf4": "nf4", "qc-q4_0": "q4_0", "qc-mxfp4": "mxfp4", "qc-fp4": "fp4", "qc-nvfp4": "nvfp4",
              "qc-nf4-grouped": "nf4", "qc-mxfp4-grouped": "mxfp4", "qc-nvfp4-grouped": "nvfp4"}
#: the qc-* variants whose q/k/v and gate/up run as grouped gemvs (quantcore.nn.group_linears)
QC_GROUPED = ("qc-nf4-grouped", "qc-mxfp4-grouped", "qc-nvfp4-grouped")
BNB_FORMATS = {"bnb-nf4": "nf4", "bnb-fp4": "fp4"}
DEFAULT_VARIANTS = ("bf16", "bnb-nf4", "qc-nf4", "qc-q4_0", "qc-mxfp4")
ALL_VARIANTS = ("bf16", *BNB_FORMATS, *QC_FORMATS)
MODES = ("eager", "compiled")
REFERENCES = ("bf16", "bnb-nf4")  #: ratios are given against these when they ran
SEED = 1234


@dataclass
class Measure:
    """One timed quantity of one variant: ``tokens_per_s`` from the median of ``times_s``."""

    tokens_per_s: float | None = None
    ms_per_step: float | None = None  #: decode: median time / steps; prefill: median time of the forward
    times_s: list[float] = field(default_factory=list)
    warmup_s: float | None = None  #: wall time of the untimed warm-up (compilation + graph capture when compiled)
    match_eager: float | None = None  #: compiled decode: share of its greedy tokens equal to eager's (same prompt)
    cudagraph_skips: int | None = None  #: compiled decode on CUDA: graphs inductor declined (then no CUDA graphs)
    error: str | None = None


@dataclass
class VariantResult:
    variant: str
    status: str = "pending"  #: ok | failed | skipped | timeout (measurements that failed: ``partial``)
    error: str | None = None
    traceback: str | None = None
    build_s: float | None = None
    quantize_s: float | None = None
    elapsed_s: float | None = None
    linear_modules: int | None = None
    linear_weight_bytes: int | None = None  #: decoder linears (the quantized ones), state tensors included
    lm_head_bytes: int | None = None
    model_bytes: int | None = None  #: every parameter, buffer and state tensor of the model
    linear_types: list[str] = field(default_factory=list)
    mem_peak_build_bytes: int | None = None
    mem_resident_bytes: int | None = None
    mem_peak_run_bytes: int | None = None
    logits_rel_err_vs_bf16: float | None = None  #: prefill logits (last position) against the bf16 variant's
    metrics: dict[str, Measure] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)  #: "vs bf16" -> metric -> ratio
    notes: list[str] = field(default_factory=list)
    from_run: str | None = None  #: set on variants merged from an earlier run's JSON


class VariantTimeout(BaseException):
    """Raised (by SIGALRM) when a variant runs past ``--timeout-per-variant``; a BaseException so that
    no ``except Exception`` on the way (ours or the libraries') swallows it."""


# -- helpers ----------------------------------------------------------------------------------------------------
def _torch():
    import torch  # noqa: PLC0415 - optional dependency

    return torch


def _cudagraph_skips() -> int | None:
    """inductor's count of CUDA graphs it declined (a compiled decode then runs without graphs)."""
    try:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 - another torch: not reported
        return None


def _err(exc: BaseException, n: int = 400) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()}"[:n]


def _metric_keys(cfg: argparse.Namespace) -> list[str]:
    keys = [f"prefill_{cfg.prefill_len}"] if cfg.prefill_len > 0 else []
    return keys + [f"decode_{m}_b{b}" for m in cfg.modes for b in cfg.batches]


def _metric_label(key: str) -> str:
    parts = key.split("_")
    return f"prefill {parts[1]}" if parts[0] == "prefill" else f"{parts[1]} {parts[2]}"


@contextlib.contextmanager
def _deadline(seconds: float | None):
    """Raise VariantTimeout in this (main) thread after ``seconds`` (SIGALRM; no-op when unavailable)."""
    usable = (seconds and seconds > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def _fire(signum, frame):
        raise VariantTimeout(f"variant ran past --timeout-per-variant {seconds:g} s")

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Clock:
    """Times a callable: CUDA events on a CUDA device (host overhead between them included), the host
    clock after a synchronize elsewhere."""

    def __init__(self, device):
        self.torch = _torch()
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn) -> float:
        """Seconds of one call of ``fn`` (the device idle before it)."""
        self.sync()
        if self.cuda:
            start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


# -- weight bytes -------------------------------------------------------------------------------------------------
def _add_tensors(obj, seen: dict, depth: int = 0) -> None:
    """Add the tensors of ``obj`` (a tensor, or a quantization state: absmax, code, offset, state2, ...)."""
    torch = _torch()
    if obj is None or depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.numel():
            seen[(obj.device.type, obj.data_ptr(), obj.nbytes)] = obj.nbytes
        return
    if hasattr(obj, "absmax"):  # quantcore.QuantState / bitsandbytes QuantState
        for name in ("absmax", "code", "offset", "state2", "scales", "global_scale"):
            _add_tensors(getattr(obj, name, None), seen, depth + 1)


def module_bytes(module, seen: dict | None = None) -> int:
    """Bytes held by ``module``: parameters, buffers, tensor attributes and quantization states (of the
    module and of its weight), each storage counted once in ``seen``."""
    seen = {} if seen is None else seen
    before = sum(seen.values())
    for m in module.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            _add_tensors(t, seen)
            _add_tensors(getattr(t, "quant_state", None), seen)
        for name, v in vars(m).items():
            if not name.startswith("_"):
                _add_tensors(v, seen)
    return sum(seen.values()) - before


# -- the model ------------------------------------------------------------------------------------------------------
def model_config(preset: str, layers: int | None):
    from transformers import LlamaConfig  # noqa: PLC0415

    kw = dict(PRESETS[preset])
    if layers:
        kw["num_hidden_layers"] = layers
    return LlamaConfig(**kw, tie_word_embeddings=False, initializer_range=0.02, use_cache=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(config, device, seed: int = SEED):
    """A bf16 LlamaForCausalLM with random weights built directly on ``device``: linear and embedding
    weights ``normal_(std=0.02)`` (the same for a given seed), norms 1."""
    torch = _torch()
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    try:  # restored however the build ends (a --timeout-per-variant alarm included)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    return model.eval()


def linear_names(model) -> list[str]:
    torch = _torch()
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def quantize_bnb(model, quant_type: str, skip=("lm_head",)) -> int:
    """Replace each nn.Linear (names in ``skip`` excepted) by ``bnb.nn.Linear4bit`` (``quant_type``,
    double quant, blocksize 64, bf16 compute) quantized from its own weight on its device."""
    torch = _torch()
    import bitsandbytes as bnb  # noqa: PLC0415

    n = 0
    for name in linear_names(model):
        if name.split(".")[-1] in skip or name in skip:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        dev = lin.weight.device
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                compute_dtype=torch.bfloat16, compress_statistics=True,
                                quant_type=quant_type, device="meta")
        w = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, blocksize=64, compress_statistics=True,
                              quant_type=quant_type, module=new)
        new.weight = w.to(dev)  # Params4bit.to quantizes a weight that is not quantized yet
        if lin.bias is not None:
            new.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, child, new)
        del lin, w
        n += 1
    return n


def quantize_qc(model, fmt: str, skip=("lm_head",)):
    import quantcore.nn as qnn  # noqa: PLC0415

    kw: dict[str, Any] = {}
    if "progress" in inspect.signature(qnn.quantize_model).parameters:
        kw["progress"] = False  # this bench prints its own progress lines
    return qnn.quantize_model(model, fmt=fmt, skip=skip, **kw) or model


def quantize_variant(model, variant: str, log: Callable[[str], None] = lambda line: None):
    """``variant``'s model made from the bf16 ``model`` (``bf16`` returns it as it is): bitsandbytes'
    modules (:func:`quantize_bnb`), quantcore's (:func:`quantize_qc`), with ``quantcore.nn.group_linears``
    for the grouped variants; ``log`` gets one line per step."""
    n = len([name for name in linear_names(model) if name != "lm_head"])
    if variant in BNB_FORMATS:
        log(f"{variant}: quantizing {n} linear layers with bitsandbytes ({BNB_FORMATS[variant]}, double quant, "
            "blocksize 64)")
        quantize_bnb(model, BNB_FORMATS[variant])
    elif variant in QC_FORMATS:
        log(f"{variant}: quantizing {n} linear layers with quantcore.nn.quantize_model"
            f"(fmt={QC_FORMATS[variant]!r}, skip=('lm_head',))")
        model = quantize_qc(model, QC_FORMATS[variant])
        if variant in QC_GROUPED:
            import quantcore.nn as qnn  # noqa: PLC0415

            log(f"{variant}: {qnn.group_linears(model)} groups (q/k/v, gate/up) made with quantcore.nn.group_linears")
    return model


def available_variants(device_type: str) -> dict[str, str | None]:
    """variant -> None when it can run here, else why not."""
    out: dict[str, str | None] = {"bf16": None}
    try:
        import bitsandbytes  # noqa: F401, PLC0415

        bnb_why = None
    except Exception as exc:  # noqa: BLE001 - not installed or broken
        bnb_why = f"bitsandbytes not usable: {_err(exc, 200)}"
    try:
        import quantcore.nn as qnn  # noqa: PLC0415

        qc_why = None if hasattr(qnn, "quantize_model") else "quantcore.nn has no quantize_model"
    except Exception as exc:  # noqa: BLE001
        qc_why = f"quantcore.nn not importable: {_err(exc, 200)}"
    out.update({v: bnb_why for v in BNB_FORMATS})
    out.update({v: qc_why for v in QC_FORMATS})
    return out


# -- timing ------------------------------------------------------------------------------------------------------------
class Runner:
    """Runs the variants one after the other; ``log`` prints one flushed line per step."""

    def __init__(self, cfg: argparse.Namespace):
        self.cfg = cfg
        self.torch = torch = _torch()
        self.device = torch.device(cfg.device)
        self.clock = Clock(self.device)
        self.t0 = time.perf_counter()
        self.results: list[VariantResult] = []
        self.notes: list[str] = []
        self.ref_logits = None
        self.eager_tokens: dict[int, Any] = {}  #: batch -> the eager decode's tokens of the current variant
        self.started = time.strftime("%Y-%m-%d %H:%M:%S")
        self.config = model_config(cfg.preset, cfg.layers)
        if self.device.type == "cuda":
            self.device_name = torch.cuda.get_device_name(self.device)
        else:
            self.device_name = platform.processor() or platform.machine()
        import transformers  # noqa: PLC0415

        self.transformers = transformers

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    # -- memory ----------------------------------------------------------------------------------------------
    def _mem(self, what: str) -> int | None:
        if self.device.type != "cuda":
            return None
        return getattr(self.torch.cuda, what)(self.device)

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def free(self) -> None:
        """Drop compiled graphs (CUDA-graph pools included) and cached blocks."""
        torch = self.torch
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):
                from torch._inductor.cudagraph_trees import reset_cudagraph_trees  # noqa: PLC0415

                reset_cudagraph_trees()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- one variant --------------------------------------------------------------------------------------------
    def run_variant(self, variant: str) -> VariantResult:
        r = VariantResult(variant)
        t0 = time.perf_counter()
        try:
            with _deadline(self.cfg.timeout_per_variant):
                self._run_variant(variant, r)
            failed = [k for k, m in r.metrics.items() if m.error]
            r.status = "partial" if failed else "ok"
        except VariantTimeout as exc:
            r.status, r.error = "timeout", str(exc)
        except Exception as exc:  # noqa: BLE001 - a variant's failure is reported, the others go on
            r.status, r.error = "failed", _err(exc)
            r.traceback = traceback.format_exc()[-4000:]
        r.elapsed_s = time.perf_counter() - t0
        self.free()
        self.log(f"{variant}: {r.status} in {r.elapsed_s:.1f} s" + (f" ({r.error})" if r.error else ""))
        return r

    def _run_variant(self, variant: str, r: VariantResult) -> None:
        torch, cfg = self.torch, self.cfg
        self._reset_peak()
        lc = self.config
        self.log(f"{variant}: building LlamaForCausalLM ({lc.num_hidden_layers} layers, hidden {lc.hidden_size}, "
                 f"vocab {lc.vocab_size}) bf16 random weights on {self.device}")
        t = time.perf_counter()
        model = build_model(self.config, self.device)
        self.clock.sync()
        r.build_s = time.perf_counter() - t
        names = [n for n in linear_names(model) if n != "lm_head"]
        if variant != "bf16":
            t = time.perf_counter()
            model = quantize_variant(model, variant, self.log)
            gc.collect()
            self.clock.sync()
            r.quantize_s = time.perf_counter() - t
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        r.mem_peak_build_bytes = self._mem("max_memory_allocated")
        r.mem_resident_bytes = self._mem("memory_allocated")
        seen: dict = {}
        r.linear_modules = len(names)
        r.linear_weight_bytes = sum(module_bytes(model.get_submodule(n), seen) for n in names)
        r.linear_types = sorted({type(model.get_submodule(n)).__module__ + "." + type(model.get_submodule(n)).__name__
                                 for n in names})
        r.lm_head_bytes = module_bytes(model.lm_head, seen)
        r.model_bytes = module_bytes(model, {})
        self.log(f"{variant}: built in {r.build_s:.1f} s" + (f", quantized in {r.quantize_s:.1f} s" if r.quantize_s
                                                              is not None else "")
                 + f"; linear weights {r.linear_weight_bytes / 1e9:.3f} GB ({', '.join(r.linear_types)})"
                 + (f", resident {r.mem_resident_bytes / 1e9:.2f} GB, build peak "
                    f"{r.mem_peak_build_bytes / 1e9:.2f} GB" if r.mem_resident_bytes is not None else ""))
        self._reset_peak()
        self.eager_tokens = {}
        with torch.no_grad():
            if cfg.prefill_len > 0:
                r.metrics[f"prefill_{cfg.prefill_len}"] = self._prefill(model, variant, r)
            for mode in cfg.modes:
                for b in cfg.batches:
                    r.metrics[f"decode_{mode}_b{b}"] = self._decode(model, variant, mode, b)
        r.mem_peak_run_bytes = self._mem("max_memory_allocated")
        del model

    def _tokens(self, batch: int, length: int):
        """Random prompt tokens, the same for every variant and mode."""
        gen = self.torch.Generator().manual_seed(SEED + 1000 * batch + length)
        return self.torch.randint(0, self.config.vocab_size, (batch, length), generator=gen).to(self.device)

    def _prefill(self, model, variant: str, r: VariantResult) -> Measure:
        cfg = self.cfg
        m = Measure()
        ids = self._tokens(1, cfg.prefill_len)
        self.log(f"{variant}: prefill {cfg.prefill_len} tokens, batch 1: {cfg.warmup} warm-up + {cfg.reps} timed")
        try:
            def fwd():
                return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

            t = time.perf_counter()
            logits = fwd()
            for _ in range(max(cfg.warmup - 1, 0)):
                fwd()
            self.clock.sync()
            m.warmup_s = time.perf_counter() - t
            self._check_logits(logits[:, -1].float(), variant, r)
            del logits
            m.times_s = [self.clock.time(fwd) for _ in range(cfg.reps)]
            med = statistics.median(m.times_s)
            m.tokens_per_s, m.ms_per_step = cfg.prefill_len / med, med * 1e3
            self.log(f"{variant}: prefill {m.tokens_per_s:,.0f} tok/s ({m.ms_per_step:.2f} ms per forward)")
        except Exception as exc:  # noqa: BLE001 - one measurement's failure is recorded (timeouts go up)
            m.error = _err(exc)
            self.log(f"{variant}: prefill failed: {m.error}")
        return m

    def _check_logits(self, logits, variant: str, r: VariantResult) -> None:
        """Finite logits, and the relative error against the bf16 variant's (same weights before quantizing)."""
        torch = self.torch
        if not bool(torch.isfinite(logits).all()):
            r.notes.append("non-finite prefill logits")
        if variant == "bf16":
            self.ref_logits = logits.detach().cpu()
        elif self.ref_logits is not None:
            ref = self.ref_logits
            r.logits_rel_err_vs_bf16 = float((logits.detach().cpu() - ref).norm() / ref.norm())

    def _decode(self, model, variant: str, mode: str, batch: int) -> Measure:
        torch, cfg = self.torch, self.cfg
        from transformers import StaticCache  # noqa: PLC0415

        m = Measure()
        cache = None
        step_fn = None
        try:
            cache = StaticCache(config=model.config, max_cache_len=cfg.prompt_len + cfg.new_tokens)
            cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            prompt = self._tokens(batch, cfg.prompt_len)
            graphs = mode == "compiled" and self.device.type == "cuda"
            if mode == "compiled":
                self.log(f"{variant}: torch.compile(model.forward, mode='reduce-overhead', fullgraph=True) for "
                         f"batch {batch} (compiles and captures in the first warm-up run)")
                step_fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
            else:
                step_fn = model
            n = cfg.new_tokens
            skips0 = _cudagraph_skips()

            def prefill():
                cache.reset()
                out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
                return out.logits[:, -1:].argmax(-1)

            def steps(tok, out: list):
                out.append(tok)
                for _ in range(n):
                    if graphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    tok = step_fn(input_ids=tok, use_cache=True, **{cache_kw: cache}).logits[:, -1:].argmax(-1)
                    out.append(tok)
                return tok

            self.log(f"{variant}: decode {mode} batch {batch}: {cfg.warmup} warm-up + {cfg.reps} timed runs of "
                     f"{n} tokens after a {cfg.prompt_len}-token prompt")
            t = time.perf_counter()
            for _ in range(cfg.warmup):
                steps(prefill(), [])
            self.clock.sync()
            m.warmup_s = time.perf_counter() - t
            for _ in range(cfg.reps):
                tok, toks = prefill(), []
                m.times_s.append(self.clock.time(lambda tok=tok, toks=toks: steps(tok, toks)))
            med = statistics.median(m.times_s)
            m.tokens_per_s, m.ms_per_step = batch * n / med, med / n * 1e3
            seq = torch.cat(toks, 1).cpu()
            if graphs and skips0 is not None:
                m.cudagraph_skips = _cudagraph_skips() - skips0
            if mode == "eager":
                self.eager_tokens[batch] = seq
            elif batch in self.eager_tokens:
                m.match_eager = float((seq == self.eager_tokens[batch]).float().mean())
            self.log(f"{variant}: decode {mode} batch {batch}: {m.tokens_per_s:,.1f} tok/s "
                     f"({m.ms_per_step:.2f} ms per step; warm-up {m.warmup_s:.1f} s"
                     + (f"; tokens = eager's: {m.match_eager:.0%}" if m.match_eager is not None else "")
                     + (f"; CUDA graphs skipped {m.cudagraph_skips}x: see torch's 'skipping cudagraphs' warning"
                        if m.cudagraph_skips else "") + ")")
        except Exception as exc:  # noqa: BLE001 - one measurement's failure is recorded (timeouts go up)
            m.error = _err(exc)
            self.log(f"{variant}: decode {mode} batch {batch} failed: {m.error}")
        finally:
            cache = step_fn = None  # noqa: F841 - the cache and the compiled function go before free()
            if mode == "compiled":
                self.free()
        return m

    # -- the run ---------------------------------------------------------------------------------------------------
    def run(self, variants: list[str], why_not: dict[str, str | None], earlier: list[VariantResult]) -> None:
        cfg = self.cfg
        self.log(f"quantcore bench --e2e: {cfg.preset} ({self.config.num_hidden_layers} layers) on {self.device} "
                 f"({self.device_name}); variants {', '.join(variants)}; modes {', '.join(cfg.modes)}; "
                 f"batches {', '.join(map(str, cfg.batches))}")
        for v in variants:
            if why_not.get(v):
                r = VariantResult(v, status="skipped", error=why_not[v])
                self.log(f"{v}: skipped ({why_not[v]})")
            else:
                r = self.run_variant(v)
            self.results.append(r)
            self.finish(earlier, write_plot=False)
        self.finish(earlier, write_plot=True)

    def ordered(self, earlier: list[VariantResult]) -> list[VariantResult]:
        mine = {r.variant for r in self.results}
        rows = self.results + [r for r in earlier if r.variant not in mine]
        order = {v: i for i, v in enumerate(ALL_VARIANTS)}
        return sorted(rows, key=lambda r: order.get(r.variant, len(order)))

    def finish(self, earlier: list[VariantResult], write_plot: bool) -> dict:
        rows = self.ordered(earlier)
        compute_ratios(rows, _metric_keys(self.cfg))
        report = self.as_dict(rows)
        if self.cfg.json:
            os.makedirs(os.path.dirname(os.path.abspath(self.cfg.json)), exist_ok=True)
            with open(self.cfg.json, "w") as f:
                json.dump(report, f, indent=1)
        self.report, self.rows = report, rows
        return report

    def signature(self) -> dict:
        """What must match for ``--merge`` to combine two runs."""
        c = self.cfg
        return {"preset": c.preset, "layers": self.config.num_hidden_layers, "prompt_len": c.prompt_len,
                "new_tokens": c.new_tokens, "prefill_len": c.prefill_len, "batches": list(c.batches),
                "device": self.device_name}

    def as_dict(self, rows: list[VariantResult]) -> dict:
        torch = self.torch
        versions = {"quantcore": __version__, "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": self.transformers.__version__}
        with contextlib.suppress(Exception):
            import bitsandbytes  # noqa: PLC0415

            versions["bitsandbytes"] = bitsandbytes.__version__
        if self.device.type == "cuda":
            versions["cuda"] = torch.version.cuda
        c = self.config
        n_params = (c.vocab_size * c.hidden_size * 2 + c.num_hidden_layers * (
            c.hidden_size * c.head_dim * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)
            + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size) + c.hidden_size)
        return {
            "kind": "quantcore bench --e2e",
            "started": self.started,
            "elapsed_s": time.perf_counter() - self.t0,
            "device": self.device_name,
            "signature": self.signature(),
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.cfg).items()},
            "model": {"class": "LlamaForCausalLM", "preset": self.cfg.preset, "layers": c.num_hidden_layers,
                      "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                      "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                      "head_dim": c.head_dim, "vocab_size": c.vocab_size, "params": n_params,
                      "attn_implementation": getattr(c, "_attn_implementation", None), "dtype": "bfloat16"},
            "versions": versions,
            "method": __doc__.split("\n\n")[2].replace("\n", " "),
            "metrics": {k: _metric_label(k) for k in _metric_keys(self.cfg)},
            "variants": [asdict(r) for r in rows],
            "notes": self.notes,
        }


def compute_ratios(rows: list[VariantResult], keys: list[str]) -> None:
    """``ratios["vs bf16"][metric]``: tokens/s of the variant over the reference's (>1: faster), and for
    ``linear_weight_bytes`` / ``mem_resident_bytes`` the variant's bytes over the reference's (<1: smaller)."""
    by = {r.variant: r for r in rows}
    for r in rows:
        r.ratios = {}
        for ref_name in REFERENCES:
            ref = by.get(ref_name)
            if ref is None or ref is r or ref.status in ("failed", "skipped", "timeout"):
                continue
            d = {}
            for k in keys:
                a, b = r.metrics.get(k), ref.metrics.get(k)
                if a and b and a.tokens_per_s and b.tokens_per_s:
                    d[k] = a.tokens_per_s / b.tokens_per_s
            for k in ("linear_weight_bytes", "mem_resident_bytes", "mem_peak_run_bytes"):
                a, b = getattr(r, k), getattr(ref, k)
                if a and b:
                    d[k] = a / b
            if d:
                r.ratios[f"vs {ref_name}"] = d


def _measure_from(d: dict) -> Measure:
    return Measure(**{k: v for k, v in d.items() if k in Measure.__dataclass_fields__})


def load_earlier(path: str, signature: dict, variants: list[str]) -> tuple[list[VariantResult], str]:
    """The variants of an earlier run at ``path`` that this run does not redo (same signature only)."""
    if not os.path.isfile(path):
        return [], f"--merge: no earlier JSON at {path}"
    try:
        with open(path) as f:
            old = json.load(f)
    except Exception as exc:  # noqa: BLE001
        return [], f"--merge: {path} unreadable ({_err(exc, 200)}): not merged"
    if old.get("signature") != signature:
        return [], f"--merge: {path} was another model, settings or device ({old.get('signature')}): not merged"
    out = []
    for d in old.get("variants", []):
        if d.get("variant") in variants or d.get("status") == "skipped":
            continue
        d = dict(d)
        d["metrics"] = {k: _measure_from(v) for k, v in d.get("metrics", {}).items()}
        d["from_run"] = d.get("from_run") or old.get("started")
        out.append(VariantResult(**{k: v for k, v in d.items() if k in VariantResult.__dataclass_fields__}))
    return out, f"--merge: {len(out)} variant(s) from the run of {old.get('started')} in {path}"


# -- report ------------------------------------------------------------------------------------------------------------
def _gb(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}" if v >= 1e9 else f"{v / 1e9:.3g}"


def _tps(m: Measure | None) -> str:
    if m is None:
        return "-"
    if m.error:
        return "failed"
    v = m.tokens_per_s
    return "-" if v is None else f"{v:,.0f}" if v >= 1000 else f"{v:.1f}"


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def table(report: dict, rows: list[VariantResult]) -> str:
    """The results table (tokens/s; GB = 1e9 bytes), then the ratios against bf16 and bnb-nf4."""
    keys = list(report["metrics"])
    m = report["model"]
    header = ["variant", "status", "linear GB", "resident GB", "run peak GB"] + \
             [_metric_label(k) + " tok/s" for k in keys] + ["elapsed s", "note"]
    lines = []
    for r in rows:
        notes = [r.error] if r.error else []
        notes += [f"{_metric_label(k)}: {r.metrics[k].error}" for k in keys if k in r.metrics and r.metrics[k].error]
        if r.logits_rel_err_vs_bf16 is not None:
            notes.append(f"logits rel err vs bf16 {r.logits_rel_err_vs_bf16:.3f}")
        low = [f"{_metric_label(k)} {r.metrics[k].match_eager:.0%}" for k in keys
               if k in r.metrics and r.metrics[k].match_eager is not None and r.metrics[k].match_eager < 1]
        if low:
            notes.append("tokens = eager's: " + ", ".join(low))
        notes += [f"{_metric_label(k)}: CUDA graphs skipped" for k in keys
                  if k in r.metrics and r.metrics[k].cudagraph_skips]
        notes += r.notes + ([f"from run {r.from_run}"] if r.from_run else [])
        lines.append([r.variant, r.status, _gb(r.linear_weight_bytes), _gb(r.mem_resident_bytes),
                      _gb(r.mem_peak_run_bytes)]
                     + [_tps(r.metrics.get(k)) for k in keys]
                     + ["-" if r.elapsed_s is None else f"{r.elapsed_s:.0f}", "; ".join(notes)])
    out = [f"quantcore {__version__} bench --e2e: LlamaForCausalLM {m['preset']} {m['layers']} layers "
           f"({m['params'] / 1e9:.2f} B params), bf16 activations, device: {report['device']}",
           *table_lines(header, lines)]
    rkeys = keys + ["linear_weight_bytes", "mem_resident_bytes"]
    rlines = []
    for r in rows:
        for ref, d in r.ratios.items():
            rlines.append([r.variant, ref] + [f"{d[k]:.2f}x" if k in d else "-" for k in rkeys])
    if rlines:
        rhead = ["variant", "ratio"] + [_metric_label(k) for k in keys] + ["linear bytes", "resident"]
        out += ["", "ratios (tok/s: >1 is faster; bytes: <1 is smaller)", *table_lines(rhead, rlines)]
    s = report["settings"]
    out += ["", f"decode: {s['new_tokens']} greedy steps after a {s['prompt_len']}-token prompt, StaticCache"
                + (f"; prefill: {s['prefill_len']} tokens, batch 1" if s["prefill_len"] else "")
                + f"; median of {s['reps']} timed runs after {s['warmup']} warm-up; GB = 1e9 bytes; resident: "
                "allocated once built; run peak: max allocated over the timed runs (the build peak, bf16 "
                "model included, is in the JSON)."]
    return "\n".join(out + report["notes"])


def plot(report: dict, rows: list[VariantResult], path: str) -> str:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    keys = list(report["metrics"])
    dkeys = [k for k in keys if k.startswith("decode")]
    pkeys = [k for k in keys if k.startswith("prefill")]
    rows = [r for r in rows if r.metrics]
    if not rows:
        return "no measurements: no plot written"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [max(len(dkeys), 1), 1.3, 1.6]})
    width = 0.8 / len(rows)

    def bars(ax, ks, get, ylabel, title, labels=None):
        for i, r in enumerate(rows):
            vals = [get(r, k) or 0.0 for k in ks]
            cont = ax.bar([j + i * width for j in range(len(ks))], vals, width, label=r.variant)
            ax.bar_label(cont, labels=[_num(v) if v else "" for v in vals], fontsize=6, rotation=90, padding=2)
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(ks))])
        ax.set_xticklabels(labels or [_metric_label(k) for k in ks], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)

    tps = lambda r, k: r.metrics[k].tokens_per_s if k in r.metrics else None  # noqa: E731
    bars(axes[0], dkeys, tps, "tokens/s", "decode (batch x steps / time)")
    bars(axes[1], pkeys, tps, "tokens/s", "prefill (batch 1)")
    mem = {"linear weights": "linear_weight_bytes", "resident": "mem_resident_bytes", "run peak": "mem_peak_run_bytes"}
    bars(axes[2], list(mem), lambda r, k: (getattr(r, mem[k]) or 0) / 1e9, "GB", "memory", labels=list(mem))
    axes[0].legend(fontsize=8)
    m = report["model"]
    fig.suptitle(f"quantcore bench --e2e: Llama {m['preset']} {m['layers']} layers on {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


# -- entry points ------------------------------------------------------------------------------------------------------
def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.replace(",", " ").split()]


def _str_list(s: str) -> list[str]:
    return [x for x in s.replace(",", " ").split()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantcore bench --e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=list(PRESETS), help="model shape (default llama3-8b)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's, 32 for llama3-8b)")
    p.add_argument("--variants", type=_str_list, default=None,
                   help=f"comma-separated, of {', '.join(ALL_VARIANTS)} (default: {', '.join(DEFAULT_VARIANTS)}; "
                        "those that cannot run here are listed as skipped)")
    p.add_argument("--batches", type=_int_list, default=[1, 8], help="decode batch sizes (default 1,8)")
    p.add_argument("--modes", type=_str_list, default=list(MODES), help="eager,compiled (default both)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens before decoding (default 16)")
    p.add_argument("--new-tokens", type=int, default=64, help="timed decode steps per run (default 64)")
    p.add_argument("--prefill-len", type=int, default=512, help="prefill tokens, batch 1 (default 512; 0: none)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per measurement; the median is kept (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1; compiled needs >= 1)")
    p.add_argument("--device", default="cuda", help="torch device (default cuda; cpu for tests)")
    p.add_argument("--timeout-per-variant", type=float, default=None,
                   help="seconds after which a variant is stopped and recorded as timeout (SIGALRM)")
    p.add_argument("--json", default=os.path.join("bench_out", "e2e.json"),
                   help="JSON report, rewritten after each variant (default bench_out/e2e.json; '' for none)")
    p.add_argument("--png", default=None, help="plot path (default: the JSON path with .png; '' for none)")
    p.add_argument("--merge", action="store_true",
                   help="keep the variants of an earlier run in the --json file that this run does not redo "
                        "(same model, settings and device only)")
    return p


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark in this process; print the table; return the report (see ``--help``)."""
    cfg = parser().parse_args(argv)
    try:
        import torch  # noqa: PLC0415
        import transformers  # noqa: F401, PLC0415
    except ImportError as exc:
        raise SystemExit(f"quantcore bench --e2e needs torch and transformers: {exc}") from None
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("quantcore bench --e2e: no CUDA device (use --device cpu --preset tiny for a CPU run)")
    bad = [m for m in cfg.modes if m not in MODES] + [v for v in (cfg.variants or []) if v not in ALL_VARIANTS]
    if bad or not cfg.batches or min(cfg.batches) < 1 or cfg.new_tokens < 1 or cfg.reps < 1:
        raise SystemExit(f"quantcore bench --e2e: bad options {bad or ''} (see --help)")
    if cfg.png is None:
        cfg.png = (os.path.splitext(cfg.json)[0] + ".png") if cfg.json else ""
    dev_type = torch.device(cfg.device).type
    why_not = available_variants(dev_type)
    variants = cfg.variants = cfg.variants or list(DEFAULT_VARIANTS)
    runner = Runner(cfg)
    earlier: list[VariantResult] = []
    if cfg.merge and cfg.json:
        earlier, note = load_earlier(cfg.json, runner.signature(), variants)
        runner.notes.append(note)
        runner.log(note)
    if "compiled" in cfg.modes and cfg.warmup < 1:
        runner.notes.append("--warmup 0 with compiled mode: compilation falls in the first timed run")
    runner.run(variants, why_not, earlier)
    report, rows = runner.report, runner.rows
    print(table(report, rows), flush=True)
    if cfg.json:
        print(f"JSON written to {cfg.json}")
    if cfg.png:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.png)), exist_ok=True)
        try:
            print(plot(report, rows, cfg.png))
        except Exception as exc:  # noqa: BLE001 - the table and JSON are out already
            print(f"plot not written: {_err(exc)}")
    return report


def main(argv: list[str] | None = None) -> int:
    """``quantcore bench --e2e [options]``: 0 when every variant that ran measured everything, else 1."""
    report = run(argv)
    bad = [v for v in report["variants"] if v["status"] in ("failed", "partial", "timeout") and not v["from_run"]]
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
