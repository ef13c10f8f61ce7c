"""The progress display of long work (checkpoint conversion, GGUF requantization, model quantization).

One implementation: tqdm on stderr where it is installed, else a plain line on stderr at most twice a
second and at the end (percent done, the count, the label of the last step); nothing when disabled. Amounts are counted in ``unit`` ("B" shows bytes
scaled to KiB/MiB/...; any other unit counts items).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


class Progress:
    """``step(amount, label)`` per piece of work done, ``close()`` at the end (or use ``with``).
    ``pieces`` (with its name, e.g. 10 "tensors") adds a count of the steps to the display."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "B", pieces: int = 0,
                 pieces_name: str = "tensors"):
        self.total, self.desc, self.enabled, self.unit = total, desc, enabled, unit
        self.pieces, self.pieces_name = pieces, pieces_name
        self.done, self.steps, self._bar, self._last = 0, 0, None, 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        scaled = unit == "B"
        self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
                         file=sys.stderr, dynamic_ncols=True)

    def _amount(self, v: int) -> str:
        return f"{v / 2**20:.1f} MiB" if self.unit == "B" else f"{v} {self.unit}"

    def step(self, amount: int = 1, label: str = "") -> None:
        self.done += amount
        self.steps += 1
        if not self.enabled:
            return
        count = f"{self.steps}/{self.pieces} {self.pieces_name}" if self.pieces else ""
        if self._bar is not None:
            if label or count:
                self._bar.set_postfix_str(" ".join(x for x in (count, label[:60]) if x), refresh=False)
            self._bar.update(amount)
            return
        now = time.monotonic()
        if now - self._last > 0.5 or self.done >= self.total:
            self._last = now
            pct = 100.0 * self.done / self.total if self.total else 100.0
            print(f"{self.desc}: {pct:5.1f}% ({count + ', ' if count else ''}{self._amount(self.done)} of "
                  f"{self._amount(self.total)})  {label[:60]}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def iterate(items: Iterable, desc: str, enabled: bool = True, unit: str = "item") -> Iterator:
    """``items`` one by one, a step of the display after each."""
    items = list(items)
    with Progress(len(items), desc, enabled, unit) as bar:
        for item in items:
            yield item
            bar.step(1)
