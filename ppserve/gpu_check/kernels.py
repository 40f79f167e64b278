"""Phase `kernels`: ppserve's GPU kernels against torch references, at fp32 and bf16 tolerances.

- The Triton paged attention on a mixed microbatch (decodes, a first prefill chunk, a later chunk) and
  the split-K decode (few sequences, long contexts), each against SDPA over the same paged cache;
- the ops the layers call (RMSNorm with and without the fused residual add, SiLU-and-multiply, RoPE)
  against float64 formulas.

On CPU the Triton kernels run under the interpreter on smaller shapes (the runner sets
TRITON_INTERPRET=1), the ops on their CPU paths.
"""

from __future__ import annotations

import random
from typing import Any

from ppserve.gpu_check.phase import Context

TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)}  # (atol, rtol)


def _paged_case(query_lens: list[int], context_lens: list[int], hq: int, hkv: int, d: int, bs: int,
                dtype: Any,
                device: str, seed: int) -> dict[str, Any]:
    """Triton vs SDPA on one microbatch over a cache with shuffled, non-contiguous block tables."""
    import torch

    from ppserve.model.attention import AttentionMetadata, SdpaBackend, allocate_kv_cache
    from ppserve.model.triton_attention import TritonPagedBackend

    rng = random.Random(seed)
    need = [-(-c // bs) for c in context_lens]
    free = list(range(sum(need) + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    torch.manual_seed(seed)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    cache = allocate_kv_cache(1, sum(need) + 2, bs, hkv, d, dtype, device)[0].normal_()
    ref_cache = cache.clone()
    scale = d ** -0.5
    got = TritonPagedBackend().forward(q, k, v, cache,
                                       AttentionMetadata.build(query_lens, context_lens, tables, bs,
                                                                               device), scale)
    want = SdpaBackend().forward(q, k, v, ref_cache,
                                 AttentionMetadata.build(query_lens, context_lens, tables, bs,
                                                                             device), scale)
    return _compare(got, want, dtype)


def _compare(got: Any, want: Any, dtype: Any) -> dict[str, Any]:
    import torch

    atol, rtol = TOLERANCES[str(dtype).removeprefix("torch.")]
    err = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    finite = bool(torch.isfinite(got).all())
    return {"max_abs_err": float(err.max()), "ok": finite and bool((err <= bound).all()), "finite": finite}


def _ops_cases(dtype: Any, device: str) -> dict[str, Any]:
    import torch

    from ppserve.model import ops

    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=dtype, device=device)
    y = torch.randn_like(x)
    w = torch.rand(256, dtype=dtype, device=device) + 0.5
    x64, y64, w64 = x.double(), y.double(), w.double()

    def rms(h: Any) -> Any:
        return w64 * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)

    total, normed = ops.add_rms_norm(x, y, w, 1e-5)
    gate_up = torch.randn(64, 512, dtype=dtype, device=device)
    g64, u64 = gate_up.double().chunk(2, dim=-1)
    heads = torch.randn(64, 4, 64, dtype=dtype, device=device)
    angles = torch.rand(64, 1, 32, dtype=torch.float64, device=device) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    h64 = heads.double()
    rotated = torch.cat((-h64[..., 32:], h64[..., :32]), dim=-1)
    return {
        "rms_norm": _compare(ops.rms_norm(x, w, 1e-5), rms(x64), dtype),
        "add_rms_norm": {"sum": _compare(total, x64 + y64, dtype),
                         "norm": _compare(normed, rms(x64 + y64), dtype)},
        "silu_mul": _compare(ops.silu_mul(gate_up), torch.nn.functional.silu(g64) * u64, dtype),
        "rope_": _compare(ops.rope_(heads.clone(), cos.to(dtype), sin.to(dtype)), h64 * cos + rotated * sin,
                          dtype),
    }


def _int4_codes(gen: Any, out: int, inp: int, group: int) -> tuple[Any, Any]:
    """Random int4 codes with zero points, and the float64 weight they encode with the scales and zeros
    rounded to bf16 as the kernel stores them."""
    import torch

    from ppserve.model.quant.codes import QuantCodes

    q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out, inp // group, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (out, inp // group), generator=gen).to(torch.int16)
    s64 = scales.bfloat16().double()
    z64 = ((8 - zeros.float()) * scales).bfloat16().double()
    w = ((q.double() - 8).view(out, -1, group) * s64[..., None] + z64[..., None]).view(out, inp)
    return QuantCodes(4, group, q, scales, zeros), w


def _quant_cases(device: str) -> dict[str, Any]:
    """The quantized linears' kernels (model/ops/quant_gemm.py) against float64 on the weights their codes
    encode (scales as the kernel stores them, in bf16): int4 in groups of 128 with zero points (CUDA:
    tinygemm, and replayed from a CUDA graph, bit for bit; FP8 where the device has it); the same codes
    with GPTQ's shuffled groups; int4 experts through the MoE's grouped path; int8 (W8A8 on CUDA)."""
    import torch

    from ppserve.model.ops.quant_gemm import QuantizedLinear
    from ppserve.model.quant.codes import QuantCodes

    gen = torch.Generator().manual_seed(0)
    out, inp, group = 256, 512, 128
    codes, w = _int4_codes(gen, out, inp, group)
    x = torch.randn(7, inp, generator=gen).to(torch.bfloat16)
    int4 = QuantizedLinear.build(codes, torch.bfloat16, torch.device(device))
    if int4 is None:
        return {"int4": {"ok": False, "finite": False, "max_abs_err": float("inf"), "why": "no int4 kernel"}}
    xd = x.to(device)
    eager = int4.linear(xd, None)
    cases: dict[str, Any] = {"int4": _compare(eager.cpu(), x.double() @ w.t(), torch.bfloat16),
                             "moe_int4": _moe_int4_case(gen, device)}
    # GPTQ desc_act: the same codes with their columns shuffled, groups named by g_idx
    shuffle = torch.randperm(inp, generator=gen)
    unsorted = QuantCodes(4, group, codes.q[:, shuffle], codes.scales, codes.zeros,
                          g_idx=(torch.arange(inp) // group)[shuffle])
    desc_act = QuantizedLinear.build(unsorted, torch.bfloat16, torch.device(device))
    shuffled = xd[:, shuffle.to(xd.device)]
    cases["int4_desc_act"] = (
        {"ok": False, "max_abs_err": float("inf"), "why": "not packed"} if desc_act is None
        else _compare(desc_act.linear(shuffled, None).cpu(), x.double() @ w.t(), torch.bfloat16))
    if device.startswith("cuda"):
        cases["int4_graph"] = _replayed(lambda: int4.linear(xd, None))
        if desc_act is not None:  # the activations' gather inside the graph too
            cases["int4_desc_act_graph"] = _replayed(lambda: desc_act.linear(shuffled, None))
        cases.update(_fp8_case(x, torch.device(device)))
        cases.update(_w8a8_case(x, torch.device(device)))
    else:
        q8 = torch.randint(1, 256, (out, inp), generator=gen, dtype=torch.uint8)
        s8 = torch.rand(out, 1, generator=gen) * 0.01 + 0.001
        int8 = QuantizedLinear.build(QuantCodes(8, inp, q8, s8, torch.full_like(s8, 128, dtype=torch.int16)),
                                     torch.bfloat16, torch.device(device))
        assert int8 is not None
        w8 = (q8.double() - 128) * s8.bfloat16().double()
        cases["int8"] = _compare(int8.linear(xd, None).cpu(), x.double() @ w8.t(), torch.bfloat16)
    return cases


def _moe_int4_case(gen: Any, device: str) -> dict[str, Any]:
    """Four int4 experts (hidden 256, intermediate 128, groups of 128) on the grouped path's per-expert
    kernels, five tokens routed to two each, against float64 on the weights the codes encode."""
    import torch

    from ppserve.model.ops import moe as moe_ops
    from ppserve.model.ops.quant_gemm import QuantizedLinear

    hidden, inter, experts = 256, 128, 4
    packed: tuple[list[Any], list[Any]] = ([], [])
    floats: tuple[list[Any], list[Any]] = ([], [])
    for e in range(2 * experts):
        out, inp = (2 * inter, hidden) if e < experts else (hidden, inter)
        codes, w = _int4_codes(gen, out, inp, 128)
        kernel = QuantizedLinear.build(codes, torch.bfloat16, torch.device(device))
        if kernel is None:
            return {"ok": False, "max_abs_err": float("inf"), "why": "no int4 kernel for the experts"}
        packed[e // experts].append(kernel)
        floats[e // experts].append(w)
    x = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 0], [3, 1], [1, 2], [0, 3]])
    weights = torch.softmax(torch.randn(5, 2, generator=gen), -1).to(torch.bfloat16)
    quantized = (moe_ops.QuantizedExperts(tuple(packed[0])), moe_ops.QuantizedExperts(tuple(packed[1])))
    stand_in = torch.empty(1, device=device, dtype=torch.bfloat16)  # the float weights, released
    got = moe_ops.grouped_experts(x.to(device), ids.to(device), weights.to(device),
                                  stand_in.expand(experts, 2 * inter, hidden),
                                  stand_in.expand(experts, hidden, inter), quantized=quantized)
    want = torch.zeros(5, hidden, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = x[t].double() @ floats[0][e].t()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            want[t] += float(weights[t, j]) * (act @ floats[1][e].t())
    return _compare(got.cpu(), want, torch.bfloat16)


def _replayed(run: Any) -> dict[str, Any]:
    """`run()` captured into a CUDA graph and replayed gives its eager output bit for bit."""
    import torch

    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    return {"ok": bool(torch.equal(captured, eager)), "max_abs_err": 0.0}


def _w8a8_case(x: Any, device: Any) -> dict[str, Any]:
    """INT8 W8A8 on CUDA (`_int_mm`, activations quantized per token, fewer than 17 rows padded): within
    int8 activation rounding (3 % of the largest output) of float64 on the int8 weight, at 7 rows and
    at 40, and its graph replay bit for bit."""
    import torch

    from ppserve.model.ops.quant_gemm import QuantizedLinear
    from ppserve.model.quant.codes import QuantCodes

    gen = torch.Generator().manual_seed(2)
    out, inp = 256, x.shape[1]
    q8 = torch.randint(1, 256, (out, inp), generator=gen, dtype=torch.uint8)
    s8 = torch.rand(out, 1, generator=gen) * 0.01 + 0.001
    codes = QuantCodes(8, inp, q8, s8, torch.full_like(s8, 128, dtype=torch.int16), int8_activations=True)
    w8a8 = QuantizedLinear.build(codes, torch.bfloat16, device)
    if w8a8 is None:
        return {"w8a8": {"ok": False, "max_abs_err": float("inf"), "why": "no int8 path for these shapes"}}
    w = (q8.double() - 128) * s8.bfloat16().double()
    cases: dict[str, Any] = {}
    for rows in (x.shape[0], 40):
        xs = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
        got = w8a8.linear(xs.to(device), None).cpu().double()
        want = xs.double() @ w.t()
        err = float((got - want).abs().max())
        cases[f"w8a8_{rows}"] = {"ok": err <= 0.03 * float(want.abs().max()), "max_abs_err": err}
    xd = x.to(device)
    cases["w8a8_graph"] = _replayed(lambda: w8a8.linear(xd, None))
    return cases


def _fp8_case(x: Any, device: Any) -> dict[str, Any]:
    """FP8 `_scaled_mm` (compute capability 8.9 and up): within FP8 activation rounding (6 % of the
    largest output) of float64 on the FP8 weight, and its graph replay bit for bit."""
    import torch

    from ppserve.model.ops.quant_gemm import QuantizedLinear, fp8_gemm_available
    from ppserve.model.quant.codes import from_fp8

    if not fp8_gemm_available(device):
        return {}
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, x.shape[1], generator=gen) * 0.1
    scale = w.abs().amax(1, keepdim=True) / 448
    codes = from_fp8((w / scale).to(torch.float8_e4m3fn), scale)
    fp8 = None if codes is None else QuantizedLinear.fp8(codes, device)
    if codes is None or fp8 is None:
        return {"fp8": {"ok": False, "max_abs_err": float("inf"), "why": "no fp8 path for these shapes"}}
    xd = x.to(device)
    eager = fp8.linear(xd, None)
    want = x.double() @ (codes.q.double() * scale.double()).t()
    err = float((eager.cpu().double() - want).abs().max())
    return {"fp8": {"ok": err <= 0.06 * float(want.abs().max()), "max_abs_err": err},
            "fp8_graph": _replayed(lambda: fp8.linear(xd, None))}


def _all_ok(tree: dict[str, Any]) -> bool:
    """Every comparison in a nested dict of them passed."""
    if "ok" in tree:
        return bool(tree["ok"])
    return all(_all_ok(v) for v in tree.values())


def run(ctx: Context) -> dict[str, Any]:
    import torch

    from ppserve.model.triton_attention import MIN_PAGES_PER_SPLIT, sm_count, split_k_plan, triton_available

    if not triton_available():
        raise RuntimeError("triton is not importable (CUDA builds of torch ship it)")
    if ctx.cuda:  # as in a CUDA stage worker: the CPU C kernels are not built (worker/devices.py)
        from ppserve.model.ops.settings import KernelSettings, configure

        configure(KernelSettings(native=False))
    device = ctx.device
    d = 128 if ctx.cuda else 64  # Llama-3's head dim on the device; the interpreter is slow
    long_ctx = 8192 if ctx.cuda else 320
    cases: dict[str, Any] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cases[f"mixed_{name}"] = _paged_case([1, 37, 1, 20], [61, 37, 45, 70], 8, 2, d, 16, dtype, device, 1)
        # Two long decodes with GQA 4 (Llama-3-8B's 32/8): the split-K path.
        cases[f"split_k_{name}"] = _paged_case([1, 1], [long_ctx, long_ctx // 3 + 5], 8, 2, d, 16, dtype,
                                               device, 2)
        cases[f"ops_{name}"] = _ops_cases(dtype, device)
    cases["quant_bfloat16"] = _quant_cases(device)
    plan = split_k_plan(2, 2, -(-long_ctx // 16), sm_count(torch.device(device)))
    if plan is None or plan < MIN_PAGES_PER_SPLIT:
        raise AssertionError(f"the split-K case did not take the split path (plan {plan})")
    return {"ok": _all_ok(cases), "cases": cases, "split_k_pages_per_split": plan, "head_dim": d}


def headline(r: dict[str, Any]) -> str:
    worst = max((c["max_abs_err"] for k, c in r["cases"].items() if k.startswith(("mixed", "split"))),
                default=0.0)
    return f"triton paged + split-K + ops vs torch, fp32/bf16: worst attention error {worst:.2e}"
