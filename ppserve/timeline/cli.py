"""`ppserve timeline TRACE.json`: draw the bubble timeline (PNG / HTML) and print the bubble summary."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("timeline", help="bubble timeline of a trace: PNG Gantt chart, HTML, text summary")
    p.add_argument("trace", help="Chrome trace JSON (save_chrome_trace) or spans .jsonl")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--html", help="also write a self-contained interactive HTML page here")
    p.add_argument("--window", default="all",
                   help="all | active | steady | T0:T1 (ms from the first span); the summary uses it too")
    p.add_argument("--compare", metavar="B.json",
                   help="draw this second run under the first, same time scale")
    p.add_argument("--no-png", action="store_true", help="print the summary only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ppserve.timeline.html import render_html
    from ppserve.timeline.render import render_compare, render_png, summary_text

    print(summary_text(args.trace, args.window))
    if args.compare:
        print()
        print(summary_text(args.compare, args.window))
    if not args.no_png:
        if args.compare:
            print(f"png: {render_compare(args.trace, args.compare, args.output, args.window)}")
        else:
            print(f"png: {render_png(args.trace, args.output, args.window)}")
    if args.html:
        print(f"html: {render_html(args.trace, args.html, args.window)}")
    return 0
