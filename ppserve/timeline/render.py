"""Bubble timeline as a picture and a text summary: load a trace, draw a Gantt chart, summarize.

The figures come from `ppserve.metrics` (spans, `idle_intervals`, `bubble_report`); this module only
loads, lays out and draws them. One lane per (stage, tp rank): compute spans colored by microbatch
composition (prefill-only blue, decode-only green, hybrid orange; darker = more tokens), bubbles as
hatched red spans, starvation as dotted grey spans, microbatch ids written where they fit; the last
stage's grammar masks (`grammar_mask` spans, inside its prepare) as a thin purple bar along the foot of
its lane, at least `MIN_MARK_FRACTION` of the window wide, as they are short beside compute; speculated
microbatches' compute (those whose spans carry draft tokens) outlined in magenta. A lower
panel shows the tokens of each microbatch when it entered the pipeline. Matplotlib (Agg) only here.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppserve.metrics.bubbles import BubbleReport, Window, bubble_report, idle_intervals, resolve_window
from ppserve.metrics.spans import Span, WorkInterval, read_jsonl, read_work_intervals
from ppserve.metrics.trace import load_chrome_trace

__all__ = [
    "Run",
    "load_run",
    "parse_window",
    "composition",
    "grammar_masks",
    "speculated_steps",
    "summary_text",
    "render_png",
    "render_compare",
]

# Composition -> (light, dark) RGB: the color is interpolated by the microbatch's token count.
PALETTE: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "prefill": ((0.74, 0.84, 0.95), (0.09, 0.32, 0.62)),
    "decode": ((0.78, 0.91, 0.76), (0.13, 0.50, 0.20)),
    "hybrid": ((0.99, 0.82, 0.60), (0.80, 0.38, 0.04)),
    "empty": ((0.85, 0.85, 0.85), (0.55, 0.55, 0.55)),
}
BUBBLE_COLOR = (0.90, 0.30, 0.30)
STARVATION_COLOR = (0.60, 0.60, 0.60)
GRAMMAR_MASK_COLOR = (0.55, 0.18, 0.72)
SPEC_COLOR = (0.85, 0.0, 0.55)  # the outline of a speculated microbatch's compute boxes
MIN_MARK_FRACTION = 0.002  # of the window: the narrowest a grammar mask is drawn, so it stays visible
MARK_HEIGHT = 0.22  # of a lane: grammar mask bars run along its foot, below the compute ids
NAMED_WINDOWS = ("all", "active", "steady")


@dataclass(frozen=True)
class Run:
    """One loaded run: its spans and work intervals (None when the engine reported none)."""

    path: Path
    spans: list[Span]
    work: list[WorkInterval] | None

    @property
    def origin_ns(self) -> int:
        """Time zero of the pictures and of T0:T1 windows: the run's first span start."""
        return min(s.start_ns for s in self.spans)

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.spans)


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read a Chrome trace written by `save_chrome_trace`, or a spans JSONL written by `write_jsonl`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    if p.suffix == ".jsonl":
        spans = read_jsonl(p)
        work: list[WorkInterval] | None = read_work_intervals(p) or None
    else:
        try:
            spans, work = load_chrome_trace(p)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{p} is not a Chrome trace JSON file ({e}); spans JSONL files must end in "
                             ".jsonl") from e
    if not any(s.stage >= 0 for s in spans):
        raise ValueError(f"{p} holds no stage spans (was it written by "
                         "ppserve.metrics.trace.save_chrome_trace?)")
    return Run(p, spans, work)


def parse_window(text: str, run: Run | None = None) -> Window:
    """'all' | 'active' | 'steady' | 'T0:T1' (milliseconds from the run's first span start)."""
    text = text.strip()
    if text in NAMED_WINDOWS:
        return text
    if ":" not in text:
        raise ValueError(f"window {text!r} is not one of {', '.join(NAMED_WINDOWS)} or T0:T1 in ms "
                         "(e.g. 10:250)")
    a, b = text.split(":", 1)
    try:
        t0, t1 = float(a) if a.strip() else 0.0, float(b)
    except ValueError:
        raise ValueError(f"window {text!r}: T0 and T1 must be numbers of milliseconds, e.g. 10:250") from None
    if not (math.isfinite(t0) and math.isfinite(t1)) or t0 < 0 or t1 <= t0:
        raise ValueError(f"window {text!r}: need 0 <= T0 < T1 (milliseconds)")
    origin = run.origin_ns if run is not None else 0
    return (origin + round(t0 * 1e6), origin + round(t1 * 1e6))


def composition(span: Span) -> str:
    if span.num_prefill_tokens and span.num_decode_tokens:
        return "hybrid"
    if span.num_prefill_tokens:
        return "prefill"
    if span.num_decode_tokens:
        return "decode"
    return "empty"


def _shade(kind: str, tokens: int, max_tokens: int) -> tuple[float, float, float]:
    light, dark = PALETTE[kind]
    # Log scale: token counts span decode-only (tens) to whole prompts (thousands).
    f = math.log1p(tokens) / math.log1p(max_tokens) if max_tokens > 0 else 0.0
    f = 0.25 + 0.75 * min(1.0, f)
    return (light[0] + f * (dark[0] - light[0]), light[1] + f * (dark[1] - light[1]),
            light[2] + f * (dark[2] - light[2]))


def grammar_masks(spans: Sequence[Span], w0: int | None = None, w1: int | None = None) -> list[Span]:
    """The stage spans of kind `grammar_mask` (overlapping [w0, w1) when given), in span order."""
    return [s for s in spans if s.kind == "grammar_mask" and s.stage >= 0
            and (w0 is None or s.end_ns >= w0) and (w1 is None or s.start_ns <= w1)]


def speculated_steps(spans: Sequence[Span]) -> dict[int, tuple[int, int | None]]:
    """step id -> (draft tokens, accepted drafts or None when unknown) of each microbatch that carried
    drafts: its schedule span says both, its compute spans the drafts (a trace without engine spans)."""
    steps: dict[int, tuple[int, int | None]] = {}
    for s in spans:
        if s.num_draft_tokens and (s.num_accepted_tokens is not None or s.step_id not in steps):
            steps[s.step_id] = (s.num_draft_tokens, s.num_accepted_tokens)
    return steps


def _microbatches(spans: Sequence[Span]) -> dict[int, Span]:
    """step id -> its compute span on the first stage (lowest tp rank): when it entered the pipeline."""
    first: dict[int, Span] = {}
    for s in spans:
        if s.kind == "compute" and s.stage >= 0:
            prev = first.get(s.step_id)
            if prev is None or (s.stage, s.tp_rank) < (prev.stage, prev.tp_rank):
                first[s.step_id] = s
    return first


# ---------------------------------------------------------------------------------------------
# Text summary


def _pct(values: Sequence[float], q: float) -> float:
    from ppserve.metrics.latency import percentile

    return percentile(values, q)


def summary_of(run: Run, window: Window = "active") -> str:
    rep: BubbleReport = bubble_report(run.spans, run.work, window)
    lines = [f"trace: {run.path}", rep.format_text()]
    origin = run.origin_ns
    lines.append(f"window [{(rep.t0_ns - origin) * 1e-6:.3f} .. {(rep.t1_ns - origin) * 1e-6:.3f}] ms "
                 f"from the first span; run length {(run.end_ns - origin) * 1e-6:.3f} ms")
    waits = list(rep.per_request_bubble_ns.values())
    if waits:
        lines.append(
            f"per-request bubble: mean {statistics.fmean(waits) * 1e-6:.3f} ms, "
            f"max {max(waits) * 1e-6:.3f} ms, p50 {_pct(waits, 50) * 1e-6:.3f} ms"
        )
    mbs = _microbatches(run.spans)
    if mbs:
        tokens = [s.num_tokens for s in mbs.values()]
        kinds = {k: sum(1 for s in mbs.values() if composition(s) == k) for k in PALETTE}
        std = statistics.pstdev(tokens)
        mean = statistics.fmean(tokens)
        lines.append(
            f"microbatch tokens: min {min(tokens)} median {statistics.median(tokens):g} max {max(tokens)} "
            f"mean {mean:.1f} std {std:.1f} cv {std / mean if mean else float('nan'):.3f}; "
            + ", ".join(f"{k} {n}" for k, n in kinds.items() if n)
        )
        durs: dict[int, list[int]] = {}
        for s in run.spans:
            if s.kind == "compute" and s.stage >= 0:
                durs.setdefault(s.stage, []).append(s.duration_ns)
        lines.append("compute ms per microbatch by stage (mean / max): " + ", ".join(
            f"{st}: {statistics.fmean(d) * 1e-6:.3f} / {max(d) * 1e-6:.3f}"
            for st, d in sorted(durs.items())))
    spec = speculated_steps(run.spans)
    if spec:
        drafts = sum(d for d, _ in spec.values())
        known = [(d, a) for d, a in spec.values() if a is not None]
        accepted = (f"; of the {sum(d for d, _ in known)} whose results are in, {sum(a for _, a in known)} "
                    "accepted" if known else "")
        lines.append(f"speculated microbatches: {len(spec)} of {len(mbs) or len(spec)}, "
                     f"{drafts} draft tokens{accepted}")
    masks = grammar_masks(run.spans)
    if masks:
        ms_each = [s.duration_ns * 1e-6 for s in masks]
        lines.append(f"grammar masks: {len(masks)} on stage(s) "
                     f"{', '.join(str(st) for st in sorted({s.stage for s in masks}))}; "
                     f"mean {statistics.fmean(ms_each):.3f} ms, max {max(ms_each):.3f} ms, "
                     f"total {sum(ms_each):.3f} ms")
    if rep.worst_stalls:
        lines.append("worst stalls (relative to the first span): " + "; ".join(
            f"stage {st.stage} tp {st.tp_rank} at {(st.start_ns - origin) * 1e-6:.3f} ms for "
            f"{st.duration_ns * 1e-6:.3f} ms" for st in rep.worst_stalls))
    return "\n".join(lines)


def summary_text(trace_path: str | os.PathLike[str], window: str | Window = "active") -> str:
    """BubbleReport.format_text() of the trace plus composition, token spread and stall timing."""
    run = load_run(trace_path)
    win = parse_window(window, run) if isinstance(window, str) else window
    return summary_of(run, win)


# ---------------------------------------------------------------------------------------------
# Pictures


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _draw_run(ax: Any, tok_ax: Any | None, run: Run, window: Window, title: str) -> float:
    """Draw one run's Gantt chart into `ax` (ms from its own start). Returns the window end in ms."""
    from matplotlib.patches import Patch

    origin = run.origin_ns
    label, win = resolve_window(run.spans, run.work, window)
    w0, w1 = win[0][0], win[-1][1]
    if isinstance(window, tuple):
        label = f"{(w0 - origin) * 1e-6:g}:{(w1 - origin) * 1e-6:g} ms"

    def ms(ns: int) -> float:
        return (ns - origin) * 1e-6

    tracks = sorted({(s.stage, s.tp_rank) for s in run.spans if s.stage >= 0})
    lane = {t: i for i, t in enumerate(tracks)}
    height = 0.8
    compute = [s for s in run.spans
               if s.kind == "compute" and s.stage >= 0 and s.end_ns > w0 and s.start_ns < w1]
    max_tokens = max((s.num_tokens for s in compute), default=1)
    by_lane: dict[int, tuple[list[tuple[float, float]], list[Any]]] = {}
    for s in compute:
        xr, colors = by_lane.setdefault(lane[(s.stage, s.tp_rank)], ([], []))
        xr.append((ms(s.start_ns), s.duration_ns * 1e-6))
        colors.append(_shade(composition(s), s.num_tokens, max_tokens))
    for i, (xr, colors) in by_lane.items():
        ax.broken_barh(xr, (i - height / 2, height), facecolors=colors, edgecolor=(1, 1, 1, 0.6),
                       linewidth=0.3)
    speculated = speculated_steps(run.spans)
    spec_lanes: dict[int, list[tuple[float, float]]] = {}
    for s in compute:
        if s.step_id in speculated:
            spec_lanes.setdefault(lane[(s.stage, s.tp_rank)], []).append(
                (ms(s.start_ns), s.duration_ns * 1e-6))
    for i, xr in spec_lanes.items():
        ax.broken_barh(xr, (i - height / 2, height), facecolors="none", edgecolor=SPEC_COLOR, linewidth=1.2,
                       zorder=2.5)

    for key, (bubbles, starved) in idle_intervals(run.spans, run.work, window).items():
        y = lane[key] - height / 2
        if bubbles:
            ax.broken_barh([(ms(a), (b - a) * 1e-6) for a, b in bubbles], (y, height),
                           facecolor=(*BUBBLE_COLOR, 0.18), edgecolor=(*BUBBLE_COLOR, 0.9), hatch="////",
                           linewidth=0.4)
        if starved:
            ax.broken_barh([(ms(a), (b - a) * 1e-6) for a, b in starved], (y, height),
                           facecolor=(*STARVATION_COLOR, 0.15), edgecolor=(*STARVATION_COLOR, 0.9),
                           hatch="..", linewidth=0.4)

    x0, x1 = ms(w0), ms(w1)
    span_ms = max(x1 - x0, 1e-9)
    ax.set_xlim(x0, x1)
    masks = grammar_masks(run.spans, w0, w1)
    mask_lanes: dict[int, list[tuple[float, float]]] = {}
    for s in masks:
        mask_lanes.setdefault(lane[(s.stage, s.tp_rank)], []).append(
            (ms(s.start_ns), max(s.duration_ns * 1e-6, span_ms * MIN_MARK_FRACTION)))
    for i, xr in mask_lanes.items():
        ax.broken_barh(xr, (i + height / 2 - MARK_HEIGHT * height, MARK_HEIGHT * height),
                       facecolors=GRAMMAR_MASK_COLOR, edgecolor="none", zorder=3)
    # Write microbatch ids where the bar is wide enough for the text (~1.2% of the axis per digit).
    fig_w = ax.figure.get_size_inches()[0] * ax.get_position().width
    min_frac_per_char = 0.075 / max(fig_w, 1e-6)
    for s in compute:
        text = str(s.step_id)
        width = s.duration_ns * 1e-6 / span_ms
        if width >= min_frac_per_char * (len(text) + 0.5):
            cx = ms(s.start_ns) + s.duration_ns * 0.5e-6
            ax.text(cx, lane[(s.stage, s.tp_rank)], text, ha="center", va="center", fontsize=7,
                    color=("white" if composition(s) != "empty" and s.num_tokens > max_tokens * 0.3
                           else "black"),
                    clip_on=True)

    ax.set_yticks(range(len(tracks)))
    multi_tp = any(r for _, r in tracks)
    ax.set_yticklabels([f"stage {s}" + (f" / tp {r}" if multi_tp else "") for s, r in tracks])
    ax.set_ylim(len(tracks) - 0.5, -0.5)  # stage 0 on top, as data flows downwards
    rep = bubble_report(run.spans, run.work, window)
    ax.set_title(f"{title}  —  window {label}: bubble {100 * rep.mean_bubble_fraction:.1f}%, "
                 f"busy {100 * rep.mean_busy_fraction:.1f}%, "
                 f"starvation {100 * rep.mean_starvation_fraction:.1f}%",
                 fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[
            Patch(facecolor=PALETTE["prefill"][1], label="prefill-only"),
            Patch(facecolor=PALETTE["decode"][1], label="decode-only"),
            Patch(facecolor=PALETTE["hybrid"][1], label="hybrid"),
            Patch(facecolor=(*BUBBLE_COLOR, 0.18), edgecolor=BUBBLE_COLOR, hatch="////", label="bubble"),
            Patch(facecolor=(*STARVATION_COLOR, 0.15), edgecolor=STARVATION_COLOR, hatch="..",
                  label="starvation"),
            *([Patch(facecolor=GRAMMAR_MASK_COLOR, label="grammar mask")] if masks else []),
            *([Patch(facecolor="none", edgecolor=SPEC_COLOR, linewidth=1.2, label="speculated")]
              if spec_lanes else []),
        ],
        loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
        title="darker = more tokens", title_fontsize=7,
    )

    if tok_ax is not None:
        mbs = [s for s in _microbatches(run.spans).values() if s.end_ns > w0 and s.start_ns < w1]
        mbs.sort(key=lambda s: s.start_ns)
        xs = [ms(s.start_ns) for s in mbs]
        widths = [max(s.duration_ns * 1e-6, span_ms * 1e-4) for s in mbs]
        pre = [s.num_prefill_tokens for s in mbs]
        dec = [s.num_decode_tokens for s in mbs]
        tok_ax.bar(xs, pre, widths, align="edge", color=PALETTE["prefill"][1], label="prefill tokens",
                   linewidth=0)
        tok_ax.bar(xs, dec, widths, bottom=pre, align="edge", color=PALETTE["decode"][1],
                   label="decode tokens", linewidth=0)
        tok_ax.set_ylabel("tokens /\nmicrobatch", fontsize=8)
        tok_ax.grid(axis="y", alpha=0.3)
        tok_ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return x1


def _figure(num_runs: int, num_lanes: Sequence[int]) -> tuple[Any, list[tuple[Any, Any]]]:
    plt = _plt()
    ratios: list[float] = []
    for n in num_lanes:
        ratios += [max(1.6, 0.45 * n), 1.0]
    fig, axes = plt.subplots(2 * num_runs, 1, figsize=(15, sum(ratios) * 0.9 + 0.8), sharex=True,
                             gridspec_kw={"height_ratios": ratios, "hspace": 0.35})
    return fig, [(axes[2 * i], axes[2 * i + 1]) for i in range(num_runs)]


def render_png(trace_path: str | os.PathLike[str], png_path: str | os.PathLike[str],
               window: str | Window = "all") -> Path:
    """Gantt chart plus tokens-per-microbatch panel of one trace, written as a PNG."""
    run = load_run(trace_path)
    win = parse_window(window, run) if isinstance(window, str) else window
    lanes = len({(s.stage, s.tp_rank) for s in run.spans if s.stage >= 0})
    fig, axes = _figure(1, [lanes])
    _draw_run(axes[0][0], axes[0][1], run, win, run.path.name)
    axes[0][1].set_xlabel("time since first span (ms)")
    out = Path(png_path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return out


def render_compare(
    a: str | os.PathLike[str], b: str | os.PathLike[str], png_path: str | os.PathLike[str],
    window: str | Window = "all",
) -> Path:
    """Two runs one above the other on one time scale, each relative to its own first span."""
    runs = [load_run(a), load_run(b)]
    wins = [parse_window(window, r) if isinstance(window, str) else window for r in runs]
    lanes = [len({(s.stage, s.tp_rank) for s in r.spans if s.stage >= 0}) for r in runs]
    fig, axes = _figure(2, lanes)
    ends = [_draw_run(ax, tok, r, w, f"{tag}: {r.path.name}")
            for (ax, tok), r, w, tag in zip(axes, runs, wins, ("A", "B"), strict=True)]
    starts = [(resolve_window(r.spans, r.work, w)[1][0][0] - r.origin_ns) * 1e-6
              for r, w in zip(runs, wins, strict=True)]
    for ax, _ in axes:
        ax.set_xlim(min(starts), max(ends))  # one shared scale: the longer run sets it
    axes[-1][1].set_xlabel("time since each run's first span (ms)")
    out = Path(png_path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return out
