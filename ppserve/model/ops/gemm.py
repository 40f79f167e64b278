"""How a linear layer's GEMM runs on CPU: ppserve's panel kernel, oneDNN's prepacked layout, or plain
F.linear.

A linear layer owns a `PackedWeight`: `prepack()` (called once after loading) lays a bf16 CPU weight out
in 16-column panels for ppserve's own GEMM where the CPU has one (AMX tiles, csrc/gemm_amx.c, or
AVX512-BF16 dot products, csrc/gemm_avx512.c), else in oneDNN's blocked layout (faster than plain
`F.linear` at decode sizes, but not at every shape). So on the oneDNN path the first GEMM of every
(out, in, rows) shape times the candidates and the fastest serves that shape from then on
(`model.linear_path: packed | plain` forces one, and turns the panel kernels off; `model.amx_kernels:
false` turns the AMX kernels off). A stage's warm-up times every row bucket its microbatches can reach
(`PackedWeight.prime`), so no serving step pays for the timing. float32 always stays on plain `F.linear`,
bit-exact with transformers. Evidence: docs/decisions.md#cpu-gemm-paths.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model.ops import native
from ppserve.model.ops.settings import current


def can_prepack(weight: Tensor) -> bool:
    """oneDNN prepacking pays off for bf16 weights on CPUs with native bf16 (AVX512-BF16 / AMX)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedWeight:
    """A bf16 weight [out, in] laid out for a fast CPU GEMM, or nothing: then `linear` is plain `F.linear`.

    Weights whose sides are multiples of 32 go to ppserve's panel kernel where the CPU has one
    (`native.panel_gemm`), always, at every row count, with no oneDNN copy kept: with AMX or AVX512-BF16
    it was at least as fast as oneDNN's best path at every shape and row count timed, and a fixed choice
    cannot be spoiled by a noisy moment the way a timed one can (docs/decisions.md#cpu-gemm-paths). Other
    weights keep oneDNN's prepacked layout, and the first GEMM of each shape times it against plain
    `F.linear` (see `fastest_path`). Held outside the module's parameters and state dict: derived from
    `weight` and rebuilt by `prepack()` after every load.
    """

    def __init__(self) -> None:
        self.packed: Tensor | None = None  # oneDNN's layout
        self.panels: Tensor | None = None  # the panel kernel's (PanelGemm.pack)
        self.kernel: str | None = None  # which panel kernel packed it: 'amx' | 'avx512'

    def pack(self, weight: Tensor, use_panels: bool = True) -> None:
        self.packed = self.panels = self.kernel = None
        if not can_prepack(weight):
            return
        kernel = native.panel_gemm() if use_panels else None
        if kernel is not None and kernel.accepts(weight):
            self.panels, self.kernel = kernel.pack(weight), kernel.kernel
        else:
            # No batch-size hint: one layout for every token count (a hint speeds up only that size).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if x.dtype != weight.dtype or x.dim() != 2:
            return F.linear(x, weight, bias)
        if self.panels is not None:
            return self.run(x, weight, bias, ("panels", x.shape[0]))
        if self.packed is None:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        bucket = row_bucket(rows)

        def candidates() -> dict[LinearPath, Callable[[], Tensor]]:
            paths = [("packed", bucket), ("plain", bucket)]
            if bucket < SMALL_GEMM_ROWS:
                paths.append(("packed", SMALL_GEMM_ROWS))
            return {path: functools.partial(self.run, x, weight, bias, path) for path in paths}

        path = fastest_path((int(weight.shape[0]), int(weight.shape[1]), bucket), candidates)
        return self.run(x, weight, bias, path)[:rows]

    def prime(self, weight: Tensor, bias: Tensor | None, max_rows: int) -> int:
        """Choose the path of every row bucket up to `max_rows` now (`fastest_path`'s timing), on zero
        rows; return how many buckets were timed. A no-op where nothing is timed (panels, plain, forced)."""
        if self.packed is None or current().linear_path in ("packed", "plain"):
            return 0
        timed = 0
        for bucket in row_buckets(max_rows):
            key = (int(weight.shape[0]), int(weight.shape[1]), bucket)
            if key not in _FASTEST:
                self.linear(weight.new_zeros(bucket, weight.shape[1]), weight, bias)
                timed += 1
        return timed

    def run(self, x: Tensor, weight: Tensor, bias: Tensor | None, path: LinearPath) -> Tensor:
        """One GEMM on `path`: x's rows zero-padded to the path's row count (the output keeps them)."""
        kind, padded = path
        if kind == "panels":  # any row count, unpadded
            kernel = native.panel_gemm(self.kernel)
            assert kernel is not None and self.panels is not None  # only taken where both exist
            return kernel(x, self.panels, bias)
        if padded != x.shape[0]:
            x = torch.cat([x, x.new_zeros(padded - x.shape[0], x.shape[1])])
        if kind == "packed":
            return cast(Tensor, torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], ""))
        return F.linear(x, weight, bias)


# How a bf16 GEMM runs: ("packed" | "plain" | "panels", the row count it runs with, rows zero-padded up to
# it for the oneDNN paths).
LinearPath = tuple[str, int]
# Small GEMMs also try running padded to this many rows: oneDNN's kernel for fewer rows can be slower
# (docs/decisions.md#cpu-gemm-paths).
SMALL_GEMM_ROWS = 64
# (out, in, row bucket) -> the path that was fastest for that shape in this process.
_FASTEST: dict[tuple[int, int, int], LinearPath] = {}


def fastest_path(key: tuple[int, int, int], candidates: Callable[[], dict[LinearPath, Callable[[], Tensor]]],
                 rounds: int = 5) -> LinearPath:
    """Time every candidate path (`candidates()` builds them) once per shape, after an untimed call each
    (the first call JIT-compiles the primitive), interleaved over `rounds`; the lowest median wins and
    every layer of that shape uses it from then on. The median, not the best run: a path that only
    sometimes runs at full speed on every thread must not win on its lucky run
    (docs/decisions.md#cpu-gemm-paths). Row counts are bucketed, so this runs for a few dozen
    shapes per model at most. `model.linear_path: packed | plain` forces that kind at the bucket's row
    count, untimed."""
    forced = current().linear_path
    if forced in ("packed", "plain"):
        return forced, key[2]
    choice = _FASTEST.get(key)
    if choice is None:
        timed = candidates()
        for fn in timed.values():
            fn()
        runs: dict[LinearPath, list[float]] = {path: [] for path in timed}
        for _ in range(rounds):
            for path, fn in timed.items():
                start = time.perf_counter()
                fn()
                runs[path].append(time.perf_counter() - start)
        choice = _FASTEST[key] = min(runs, key=lambda path: statistics.median(runs[path]))
    return choice


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a GEMM of 1 .. `max_rows` rows falls in, smallest first."""
    out = [32 * i for i in range(1, min(row_bucket(max_rows), 512) // 32 + 1)]
    return out + list(range(768, row_bucket(max_rows) + 1, 256))


def row_bucket(rows: int) -> int:
    """Token counts rounded up to a few sizes: oneDNN builds and caches a primitive (~0.6 MiB of JIT
    code and scratch) for every distinct row count, so unbucketed sizes grew each stage by ~600 MiB over
    a soak run. Multiples of 32 up to 512, then of 256: at most a few dozen primitives per weight, and
    small batches cost the same anyway (they are bound by reading the weight)."""
    step = 32 if rows <= 512 else 256
    return -(-rows // step) * step
