"""Make the bitsandbytes golden vectors with bitsandbytes' CUDA path (run on the GPU machine).

    python3 tools/make_golden_bnb.py OUTDIR

Writes OUTDIR/bnb_golden.npz (4-bit NF4/FP4 with and without double quantization for every
blocksize and input dtype, blockwise 8-bit, the code tables) and
OUTDIR/bnb_linear4bit_{nf4,fp4}.safetensors (a Linear4bit state dict as transformers saves it,
with bitsandbytes' dequantized weight beside it). bitsandbytes' CPU path is not bit-identical to
its CUDA path (docs/formats.md), so this must run on a GPU. tests/test_golden_bnb.py reads the files.
"""

import sys

import bitsandbytes as bnb
import bitsandbytes.functional as F
import numpy as np
import torch

N = 2 * 4096 + 1  # odd, partial last block for every blocksize up to 4096
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BS4 = (32, 64, 128, 256, 512, 1024, 2048, 4096)
BS8 = (64, 128, 256, 512, 1024, 2048, 4096)


def raw(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def main(outdir: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(N, generator=gen) * torch.exp(torch.randn(N, generator=gen))
    base[320:384] = 0.0  # an all-zero block for blocksizes <= 64
    out: dict[str, np.ndarray] = {"n": np.array([N]), "bnb_version": np.frombuffer(bnb.__version__.encode(), np.uint8)}
    out["dynamic_map"] = raw(F.create_dynamic_map(signed=True))
    for qt in ("nf4", "fp4"):
        out[f"code_{qt}"] = raw(F.get_4bit_type(qt, device="cpu"))
    for dname, dt in DTYPES.items():
        x = base.to(dt).cuda()
        out[f"x_{dname}"] = raw(x)
        for qt in ("nf4", "fp4"):
            for bs in BS4:
                for nested in (False, True):
                    key = f"{qt}_{dname}_{bs}_{'dq' if nested else 'plain'}"
                    try:
                        packed, st = F.quantize_4bit(x, blocksize=bs, compress_statistics=nested, quant_type=qt)
                    except Exception as exc:  # record what bitsandbytes refuses
                        print("skip", key, exc)
                        continue
                    deq = F.dequantize_4bit(packed, st)
                    out[key + "_packed"] = raw(packed)
                    out[key + "_absmax"] = raw(st.absmax)
                    out[key + "_out"] = raw(deq)
                    if nested:
                        out[key + "_absmax2"] = raw(st.state2.absmax)
                        out[key + "_offset"] = raw(st.offset.reshape(1).float())
                        out[key + "_code2"] = raw(st.state2.code)
        for bs in BS8:
            key = f"q8_{dname}_{bs}"
            codes, st = F.quantize_blockwise(x, blocksize=bs)
            out[key + "_codes"] = raw(codes)
            out[key + "_absmax"] = raw(st.absmax)
            out[key + "_out"] = raw(F.dequantize_blockwise(codes, st))
    np.savez_compressed(f"{outdir}/bnb_golden.npz", **out)

    from safetensors.torch import save_file

    wgen = torch.Generator().manual_seed(99)
    w = (torch.randn(64, 96, generator=wgen) * 0.05).to(torch.bfloat16)
    for qt in ("nf4", "fp4"):
        lin = bnb.nn.Linear4bit(96, 64, bias=False, compute_dtype=torch.bfloat16,
                                compress_statistics=True, quant_type=qt)
        lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type=qt,
                                       compress_statistics=True, blocksize=64)
        lin = lin.cuda()
        sd = {f"layer.{k}": v.detach().contiguous().cpu() for k, v in lin.state_dict().items()}
        sd["reference.weight_dequantized"] = F.dequantize_4bit(lin.weight.data, lin.weight.quant_state).cpu()
        sd["reference.weight_original"] = w.clone()
        save_file(sd, f"{outdir}/bnb_linear4bit_{qt}.safetensors")
        print(qt, {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items()})


if __name__ == "__main__":
    main(sys.argv[1])
