"""Bubble timeline tool: Gantt chart (PNG), interactive page (HTML) and text summary of a trace.

Reads Chrome traces written by `ppserve.metrics.trace.save_chrome_trace` (or spans JSONL); every
figure comes from `ppserve.metrics`. Imports matplotlib lazily, only when a picture is drawn.
"""

from ppserve.timeline.html import render_html
from ppserve.timeline.render import load_run, parse_window, render_compare, render_png, summary_text

__all__ = ["load_run", "parse_window", "render_compare", "render_html", "render_png", "summary_text"]
