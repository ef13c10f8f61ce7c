"""Peak memory and time of quantcore.io.gguf.requantize_gguf on a synthetic 768 MiB GGUF.

    PYTHONPATH=. python tools/dev/gguf_requantize_memory.py /tmp/big.gguf q4_0

Makes the file once (two 8192x4096 F16 embeddings, four 4096x4096 F16 and four 8192x4096 F32
weights, an F32 norm), then requantizes it to ``/tmp/big.<fmt>.gguf`` while a thread samples the
process's anonymous resident memory (RssAnon) every 20 ms; prints the time, the peak RssAnon and
ru_maxrss (which also counts the memory-mapped input pages still resident).
"""

import os
import resource
import sys
import threading
import time

import numpy as np

from quantcore.io import gguf as qg

K = 4096


def make(path: str) -> None:
    rng = np.random.default_rng(0)

    def w(rows, cols, dtype):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(dtype)

    tensors = [("token_embd.weight", (K, 2 * K), qg.F16, w(2 * K, K, np.float16)),
               ("output.weight", (K, 2 * K), qg.F16, w(2 * K, K, np.float16)),
               ("output_norm.weight", (K,), qg.F32, np.ones(K, np.float32))]
    for i in range(4):
        tensors.append((f"blk.{i}.attn_q.weight", (K, K), qg.F16, w(K, K, np.float16)))
        tensors.append((f"blk.{i}.ffn_up.weight", (K, 2 * K), qg.F32, w(2 * K, K, np.float32)))
    qg.write_gguf(path, [qg.KV("general.architecture", qg.ValueType.STRING, "llama")], tensors)


def main(path: str, fmt: str) -> None:
    if not os.path.exists(path):
        make(path)
    peak, stop = [0], [False]

    def sample():
        while not stop[0]:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]))
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    s = qg.requantize_gguf(path, f"{os.path.splitext(path)[0]}.{fmt}.gguf", fmt, progress=False)
    dt = time.perf_counter() - t
    stop[0] = True
    th.join()
    print(f"{fmt}: {dt:.1f} s, {s['bytes_in'] / 2**20:.0f} MiB -> {s['bytes_out'] / 2**20:.0f} MiB, "
          f"peak RssAnon {peak[0] / 1024:.0f} MiB, ru_maxrss "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "q4_0")
