"""The bubble timeline as one self-contained HTML page: inline SVG plus a few lines of JS, no external URLs.

Same layout and colors as the PNG (`ppserve.timeline.render`): one lane per (stage, tp rank),
compute spans by composition, bubbles and starvation as hatched spans. Hovering a compute span shows
its microbatch id, stage, times, token counts and request ids; hovering a bubble shows its length.
Grammar masks (`grammar_mask` spans) are a thin purple bar along the foot of their lane, at least
`MIN_MARK_PX` wide (they are short beside compute); hovering one shows its microbatch and length.
Speculated microbatches' compute boxes are outlined in magenta, their tips giving drafts and accepted.
The text summary sits under the picture.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from ppserve.metrics.bubbles import Window, idle_intervals, resolve_window
from ppserve.timeline.render import (
    BUBBLE_COLOR,
    GRAMMAR_MASK_COLOR,
    SPEC_COLOR,
    STARVATION_COLOR,
    composition,
    grammar_masks,
    load_run,
    parse_window,
    speculated_steps,
    summary_of,
)
from ppserve.timeline.render import _shade as shade

__all__ = ["render_html"]

WIDTH = 1400  # px of the time axis
LANE_H = 28
LEFT = 110
TOP = 30
MAX_REQUEST_IDS = 12  # in a tooltip; the rest are counted
MIN_MARK_PX = 2.0  # the narrowest a grammar mask is drawn, so it stays visible and hoverable
MARK_H = 6  # px: grammar mask bars run along the foot of the lane, below the compute ids


def _rgb(c: tuple[float, float, float]) -> str:
    return "rgb({},{},{})".format(*(round(255 * x) for x in c))


_SCRIPT = """
const tip = document.getElementById('tip');
document.querySelectorAll('[data-tip]').forEach(el => {
  el.addEventListener('mousemove', e => {
    tip.style.display = 'block'; tip.textContent = el.dataset.tip;
    tip.style.left = (e.pageX + 12) + 'px'; tip.style.top = (e.pageY + 12) + 'px';
  });
  el.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
});
"""


def render_html(trace_path: str | os.PathLike[str], html_path: str | os.PathLike[str],
                window: str | Window = "all") -> Path:
    run = load_run(trace_path)
    win = parse_window(window, run) if isinstance(window, str) else window
    label, intervals = resolve_window(run.spans, run.work, win)
    w0, w1 = intervals[0][0], intervals[-1][1]
    scale = WIDTH / max(w1 - w0, 1)
    origin = run.origin_ns

    def x(ns: int) -> float:
        return LEFT + (min(max(ns, w0), w1) - w0) * scale

    tracks = sorted({(s.stage, s.tp_rank) for s in run.spans if s.stage >= 0})
    lane = {t: i for i, t in enumerate(tracks)}
    compute = [s for s in run.spans
               if s.kind == "compute" and s.stage >= 0 and s.end_ns > w0 and s.start_ns < w1]
    max_tokens = max((s.num_tokens for s in compute), default=1)
    height = TOP + len(tracks) * LANE_H + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        '<defs><pattern id="bub" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="{_rgb(BUBBLE_COLOR)}" fill-opacity="0.15"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{_rgb(BUBBLE_COLOR)}" stroke-width="2"/></pattern>'
        '<pattern id="starve" width="5" height="5" patternUnits="userSpaceOnUse">'
        f'<circle cx="2.5" cy="2.5" r="1" fill="{_rgb(STARVATION_COLOR)}"/></pattern></defs>',
    ]
    for (stage, rank), i in lane.items():
        y = TOP + i * LANE_H
        parts.append(f'<text x="5" y="{y + LANE_H * 0.6:.1f}">stage {stage} / tp {rank}</text>')
    for key, (bubbles, starved) in idle_intervals(run.spans, run.work, win).items():
        y = TOP + lane[key] * LANE_H + 2
        for kind, fill, ivs in (("bubble", "url(#bub)", bubbles), ("starvation", "url(#starve)", starved)):
            for a, b in ivs:
                tip = (f"{kind}: stage {key[0]} tp {key[1]}, {(a - origin) * 1e-6:.3f} ms "
                       f"for {(b - a) * 1e-6:.3f} ms")
                parts.append(f'<rect x="{x(a):.2f}" y="{y}" width="{max(x(b) - x(a), 0.5):.2f}" '
                             f'height="{LANE_H - 4}" fill="{fill}" data-tip="{html.escape(tip)}"/>')
    speculated = speculated_steps(run.spans)
    for s in compute:
        y = TOP + lane[(s.stage, s.tp_rank)] * LANE_H + 2
        drafts, accepted = speculated.get(s.step_id, (0, None))
        rids = list(s.request_ids[:MAX_REQUEST_IDS])
        more = len(s.request_ids) - len(rids)
        tip = (f"microbatch {s.step_id} ({composition(s)}) on stage {s.stage} tp {s.tp_rank}: "
               f"{(s.start_ns - origin) * 1e-6:.3f} .. {(s.end_ns - origin) * 1e-6:.3f} ms; "
               f"tokens {s.num_tokens} (prefill {s.num_prefill_tokens}, decode {s.num_decode_tokens}); "
               f"requests {', '.join(rids)}" + (f" and {more} more" if more > 0 else ""))
        if drafts:
            tip += f"; speculated: {drafts} draft tokens" + (f", {accepted} accepted" if accepted is not None
                                                             else "")
        stroke = (f'stroke="{_rgb(SPEC_COLOR)}" stroke-width="1.5" data-kind="speculated" ' if drafts
                  else 'stroke="white" stroke-width="0.3" ')
        w = max(x(s.end_ns) - x(s.start_ns), 0.5)
        parts.append(
            f'<rect x="{x(s.start_ns):.2f}" y="{y}" width="{w:.2f}" height="{LANE_H - 4}" '
            f'fill="{_rgb(shade(composition(s), s.num_tokens, max_tokens))}" '
            + stroke
            + f'data-step="{s.step_id}" data-tip="{html.escape(tip)}"/>'
        )
        if w > 7 * (len(str(s.step_id)) + 1):
            parts.append(f'<text x="{x(s.start_ns) + w / 2:.2f}" y="{y + LANE_H * 0.55:.1f}" '
                         f'text-anchor="middle" pointer-events="none">{s.step_id}</text>')
    masks = grammar_masks(run.spans, w0, w1)
    for s in masks:
        y = TOP + lane[(s.stage, s.tp_rank)] * LANE_H + LANE_H - 2 - MARK_H
        tip = (f"grammar mask for microbatch {s.step_id} on stage {s.stage} tp {s.tp_rank}: "
               f"{(s.start_ns - origin) * 1e-6:.3f} ms for {s.duration_ns * 1e-6:.3f} ms")
        parts.append(f'<rect x="{x(s.start_ns):.2f}" y="{y}" '
                     f'width="{max(x(s.end_ns) - x(s.start_ns), MIN_MARK_PX):.2f}" height="{MARK_H}" '
                     f'fill="{_rgb(GRAMMAR_MASK_COLOR)}" data-kind="grammar_mask" '
                     f'data-tip="{html.escape(tip)}"/>')
    axis_y = TOP + len(tracks) * LANE_H + 14
    for k in range(11):
        t = w0 + (w1 - w0) * k / 10
        parts.append(f'<text x="{LEFT + WIDTH * k / 10:.1f}" y="{axis_y}" text-anchor="middle">'
                     f'{(t - origin) * 1e-6:.2f}</text>')
    parts.append(f'<text x="{LEFT + WIDTH / 2}" y="{axis_y + 16}" text-anchor="middle">ms since first span '
                 f'(window {html.escape(label)})</text></svg>')
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>ppserve timeline: {html.escape(run.path.name)}</title>"
        "<style>body{font-family:sans-serif;margin:16px}#tip{position:absolute;display:none;background:#fffbe6;"
        "border:1px solid #999;padding:4px 6px;font-size:12px;max-width:520px;pointer-events:none}"
        "pre{font-size:12px}</style></head><body>"
        f"<h3>ppserve timeline: {html.escape(run.path.name)}</h3>"
        "<p>blue: prefill-only, green: decode-only, orange: hybrid (darker = more tokens); "
        "red hatch: bubble; grey dots: starvation"
        + ("; purple foot bar: grammar mask" if masks else "")
        + ("; magenta outline: speculated" if speculated else "")
        + ". Hover for details.</p>"
        + "".join(parts)
        + f"<pre>{html.escape(summary_of(run, win))}</pre><div id=\"tip\"></div>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )
    out = Path(html_path)
    out.write_text(page, encoding="utf-8")
    return out
