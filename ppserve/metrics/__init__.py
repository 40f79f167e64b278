"""Observability as data: spans, bubble math, Chrome/Perfetto trace export, latency statistics.

Pure Python (stdlib only) so the engine, the simulator and the unit tests share it; never imports
torch, ray or grpc.
"""

from ppserve.metrics.bubbles import (
    BubbleReport,
    StageStats,
    Stall,
    bubble_report,
    gpipe_bubble_fraction,
    idle_intervals,
    per_request_bubble_ns,
)
from ppserve.metrics.control_plane import control_plane_latency
from ppserve.metrics.latency import RequestTiming, percentile, summarize
from ppserve.metrics.spans import (
    NULL_RECORDER,
    Span,
    SpanRecorder,
    WorkInterval,
    WorkTracker,
    estimate_offset,
    read_jsonl,
    read_work_intervals,
    shift,
    write_jsonl,
)
from ppserve.metrics.trace import (
    load_chrome_trace,
    save_chrome_trace,
    to_chrome_trace,
    validate_chrome_trace,
)

__all__ = [
    "BubbleReport",
    "NULL_RECORDER",
    "RequestTiming",
    "Span",
    "SpanRecorder",
    "StageStats",
    "Stall",
    "WorkInterval",
    "WorkTracker",
    "bubble_report",
    "control_plane_latency",
    "estimate_offset",
    "gpipe_bubble_fraction",
    "idle_intervals",
    "load_chrome_trace",
    "per_request_bubble_ns",
    "percentile",
    "read_jsonl",
    "read_work_intervals",
    "save_chrome_trace",
    "shift",
    "summarize",
    "to_chrome_trace",
    "validate_chrome_trace",
    "write_jsonl",
]
