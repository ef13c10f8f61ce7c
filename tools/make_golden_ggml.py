"""Make the ggml golden vectors with gguf-py (llama.cpp's PyPI package ``gguf``).

    python tools/make_golden_ggml.py tests/golden

Writes ggml_golden.npz: seeded fp32 inputs (with an all-zero block, tied maxima, a negative
maximum, tiny and huge scales), their Q4_0 and Q8_0 bytes and dequantized values as gguf-py
computes them. gguf-py has no Q8_1; Q8_1 shares Q8_0's d and q, which the test checks.
"""

import sys

import gguf
import numpy as np
from gguf import quants


def main(outdir: str) -> None:
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((96, 512)).astype(np.float32)
    x *= np.exp(rng.uniform(-12, 12, (96, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = 2.0
    x[2, 32:64] = -np.abs(x[2, 32:64])
    out = {"x": x, "gguf_version": np.frombuffer(gguf.__version__.encode() if hasattr(gguf, "__version__") else b"?", np.uint8)}
    for kind in ("Q4_0", "Q8_0"):
        t = getattr(gguf.GGMLQuantizationType, kind)
        q = quants.quantize(x, t)
        out[kind] = q
        out[kind + "_deq"] = quants.dequantize(q, t).astype(np.float32)
    np.savez_compressed(f"{outdir}/ggml_golden.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1])
