"""Decode attention on CPU: the torch path (gather every context through the block table, then SDPA)
against the native kernel that reads the paged cache in place, side by side in one run.

    python benchmarks/bench_paged_decode.py                       # SmolLM2-135M shapes, 48 decodes
    python benchmarks/bench_paged_decode.py --decodes 8 --min-ctx 16 --max-ctx 64 --repeats 3   # smoke

One layer's decode attention for `--decodes` sequences with contexts drawn from [min-ctx, max-ctx],
their blocks scattered through the cache as after many allocations. Prints per-call times (median of
`--repeats` rounds of `--calls` calls), the speed-up, the bytes of K/V read per call and the bandwidth
that implies, and the largest difference between the two outputs; writes the figures as JSON. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from ppserve.model.attention import AttentionMetadata, SdpaBackend
from ppserve.model.backend_select import select_backend


def _scattered_batch(decodes: int, min_ctx: int, max_ctx: int, block_size: int, seed: int):
    rng = random.Random(seed)
    contexts = [rng.randint(min_ctx, max_ctx) for _ in range(decodes)]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 16
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in contexts]
    return AttentionMetadata.build([1] * decodes, contexts, tables, block_size), num_blocks


def _time_calls(fn, calls: int, repeats: int) -> float:
    fn()  # warm-up: allocations, oneDNN/OpenMP start-up
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=48)
    ap.add_argument("--min-ctx", type=int, default=128)
    ap.add_argument("--max-ctx", type=int, default=1088)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/paged_decode.json"))
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    native = select_backend("cpu", "cpu_paged")  # a clear error where the kernel cannot be built
    torch_path = SdpaBackend()
    meta, num_blocks = _scattered_batch(args.decodes, args.min_ctx, args.max_ctx, args.block_size, args.seed)
    scale = args.head_dim ** -0.5
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, num_blocks, args.block_size, args.kv_heads, args.head_dim).to(dtype)
        query = torch.randn(args.decodes, args.heads, args.head_dim).to(dtype)
        want = torch_path._decodes(query, cache, meta, scale)
        got = native._decodes(query, cache, meta, scale)
        t_torch = _time_calls(
            partial(torch_path._decodes, query, cache, meta, scale), args.calls, args.repeats
        )
        t_native = _time_calls(partial(native._decodes, query, cache, meta, scale), args.calls, args.repeats)
        kv_bytes = 2 * sum(meta.context_lens) * args.kv_heads * args.head_dim * cache.element_size()
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "torch_gather_sdpa_ms": t_torch * 1e3,
            "native_ms": t_native * 1e3,
            "speedup": t_torch / t_native,
            "kv_mib_per_call": kv_bytes / 2**20,
            "native_gb_per_s": kv_bytes / t_native / 1e9,
            "max_abs_diff": (got.float() - want.float()).abs().max().item(),
        }
        rows.append(row)
        print(
            f"{row['dtype']:>8}: torch gather+SDPA {row['torch_gather_sdpa_ms']:7.2f} ms | native "
            f"{row['native_ms']:6.2f} ms "
            f"| {row['speedup']:5.2f}x | K/V {row['kv_mib_per_call']:.1f} MiB per call = "
            f"{row['native_gb_per_s']:.1f} GB/s | max |diff| {row['max_abs_diff']:.2e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                    "contexts": meta.context_lens, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
