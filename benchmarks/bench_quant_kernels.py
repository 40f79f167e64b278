"""Weight-only quantized GEMMs on this CPU against bf16, for choosing issue 61's kernels.

Times one pass over SmolLM2-135M's distinct weight shapes (the four projections and the tied LM head)
at decode row counts, four ways, interleaved:

- `bf16`: ppserve's bf16 linear as a stage runs it (`PackedWeight`: panel kernel, oneDNN or `F.linear`);
- `int8`: torch's `_weight_int8pack_mm` (per-channel symmetric scales);
- `int4`: torch's `_weight_int4pack_mm_for_cpu` on `_convert_weight_to_int4pack_for_cpu`'s layout
  (group-wise scales and float zero points, group 64);
- `int4_dequant`: the same packed weight dequantized to bf16 at each call and multiplied
  (ppserve/model/ops/int4_dequant.py, what an int4 layer runs from INT4_DEQUANT_MIN_ROWS rows);
- `fp8`: `torch._scaled_mm` on float8_e4m3fn weights and per-token activations, where it runs on CPU.

torchao's weight-only int8 layer is timed as a fifth way where torchao imports (it is not a dependency).

    python benchmarks/bench_quant_kernels.py [--rows 1,4,16,64,128,256,512] [--repeats 30] [--layers-only]

`--layers-only` leaves out the LM head, which a quantized checkpoint keeps in bf16: the pass a decoder
layer's quantized weights make.

Prints microseconds per pass and each way's ratio to bf16, and the largest error of each way's output
against float32 on the dequantized weight. Writes results/bench_quant_kernels.json (or --out). Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from ppserve.bench.report import write_json
from ppserve.model.ops import int4_dequant
from ppserve.model.ops.gemm import PackedWeight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
GROUP = 64
ERRS = ("int8", "int4", "int4_dequant", "fp8")  # the ways whose error against float32 is printed


def _quantized(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each way's GEMM closure for float32 weight `w`, and 'ref_*' closures on its dequantized weight."""
    out_f, in_f = w.shape
    bf16 = w.bfloat16()
    packed = PackedWeight()
    packed.pack(bf16)
    s8 = w.abs().amax(1) / 127
    q8 = torch.round(w / s8[:, None]).clamp(-128, 127).to(torch.int8)
    wg = w.view(out_f, in_f // GROUP, GROUP)
    low, high = wg.amin(-1), wg.amax(-1)
    s4 = (high - low).clamp_min(1e-8) / 15
    q4 = torch.round((wg - low[..., None]) / s4[..., None]).clamp(0, 15)
    # tinygemm's dequantization is (q - 8) * scale + zero, the zero point in the float domain
    scales_zeros = torch.stack([s4, low + 8 * s4], -1).transpose(0, 1).contiguous().bfloat16()
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32).view(out_f, in_f), 1)
    w4 = (q4 * s4[..., None] + low[..., None]).view(out_f, in_f)
    fp8 = (w / (w.abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
    fp8_scale = (w.abs().amax(1) / 448)[None, :]

    def fp8_mm(x: torch.Tensor) -> torch.Tensor:
        xs = x.float().abs().amax(1, keepdim=True).clamp_min(1e-8) / 448
        x8 = (x.float() / xs).to(torch.float8_e4m3fn)
        return torch._scaled_mm(x8, fp8.t(), scale_a=xs, scale_b=fp8_scale, out_dtype=torch.bfloat16)

    return {
        "bf16": lambda x: packed.linear(x, bf16, None),
        "int8": lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8.bfloat16()),
        "int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, GROUP, scales_zeros),
        "int4_dequant": lambda x: int4_dequant.dequantized_matmul(x, int4, scales_zeros, GROUP, out_f),
        "fp8": fp8_mm,
        "ref_bf16": lambda x: x.float() @ w.t(),
        "ref_int8": lambda x: x.float() @ (q8.float() * s8[:, None]).t(),
        "ref_int4": lambda x: x.float() @ w4.t(),
        "ref_int4_dequant": lambda x: x.float() @ w4.t(),
        "ref_fp8": lambda x: x.float() @ (fp8.float() * fp8_scale.t()).t(),
    }


def _torchao_int8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception:
        return None
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(w)
    quantize_(layer, Int8WeightOnlyConfig())
    return lambda x: layer(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,128,256,512")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--layers-only", action="store_true", help="leave out the LM head")
    ap.add_argument("--out", default="results/bench_quant_kernels.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.layers_only:
        del SHAPES["lm_head"]
    ways = {name: _quantized(torch.randn(shape) * 0.05) for name, shape in SHAPES.items()}
    ao = {name: _torchao_int8(torch.randn(shape) * 0.05) for name, shape in SHAPES.items()}
    kinds = ["bf16", "int8", "int4", "int4_dequant", "fp8"] + (["torchao_int8"] if all(ao.values()) else [])
    results = []
    print("| rows | " + " | ".join(f"{k} us" for k in kinds) + " | " +
          " | ".join(f"{k}/bf16 speed" for k in kinds[1:]) + " | max rel err " + " / ".join(ERRS) + " |")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {name: torch.randn(rows, shape[1]).bfloat16() for name, shape in SHAPES.items()}

            def one_pass(kind: str, xs: dict[str, torch.Tensor] = xs) -> None:
                for name in SHAPES:
                    fn = ao[name] if kind == "torchao_int8" else ways[name][kind]
                    assert fn is not None
                    fn(xs[name])

            times: dict[str, list[float]] = {k: [] for k in kinds}
            for k in kinds:
                one_pass(k)
            for _ in range(args.repeats):
                for k in kinds:
                    start = time.perf_counter()
                    one_pass(k)
                    times[k].append((time.perf_counter() - start) * 1e6)
            us = {k: statistics.median(v) for k, v in times.items()}
            errs = {}
            for k in ERRS:
                worst = 0.0
                for name in SHAPES:
                    ref = ways[name][f"ref_{k}"](xs[name])
                    got = ways[name][k](xs[name]).float()
                    worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
                errs[k] = worst
            results.append({"rows": rows, "us": us, "max_rel_err": errs})
            print(f"| {rows} | " + " | ".join(f"{us[k]:.0f}" for k in kinds) + " | " +
                  " | ".join(f"{us['bf16'] / us[k]:.2f}x" for k in kinds[1:]) + " | " +
                  " / ".join(f"{errs[k]:.1e}" for k in ERRS) + " |", flush=True)
    write_json(args.out, {"args": vars(args), "shapes": SHAPES, "group": GROUP,
                          "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
                          "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
