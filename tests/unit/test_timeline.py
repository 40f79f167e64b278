"""The timeline tool on synthetic traces with known answers: PNG/HTML produced, summary figures exact."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from ppserve.metrics.spans import Span, write_jsonl
from ppserve.metrics.trace import save_chrome_trace
from ppserve.timeline import cli as timeline_cli
from ppserve.timeline import load_run, parse_window, render_compare, render_html, render_png, summary_text

MS = 1_000_000


def gpipe(p: int, m: int, d: int = 10 * MS, prefill: int = 0, decode: int = 4) -> list[Span]:
    """Stage s computes microbatch j during [(s+j)d, (s+j+1)d)."""
    return [
        Span("compute", (s + j) * d, (s + j + 1) * d, s, 0, j, prefill, decode, (f"r{j}", f"q{j}"))
        for s in range(p)
        for j in range(m)
    ]


@pytest.fixture
def gpipe_trace(tmp_path):
    path = tmp_path / "gpipe.json"
    save_chrome_trace(path, gpipe(4, 6))
    return path


def test_summary_gpipe_bubble_exact(gpipe_trace):
    text = summary_text(gpipe_trace, "all")
    # (p-1)/(m+p-1) = 3/9 for every stage and the mean.
    assert "window: all" in text
    assert text.count(" 33.33%") == 5
    assert re.search(r"mean\s+66\.67%\s+33\.33%\s+0\.00%", text)
    assert "microbatch tokens: min 4 median 4 max 4" in text
    assert "cv 0.000" in text
    assert "decode 6" in text
    # Per-request bubble: each microbatch hops straight from stage to stage, so 0.
    assert "p50 0.000 ms" in text


def test_summary_per_request_and_stalls(tmp_path):
    # Two stages; microbatch 1 waits 5 ms between stage 0 and stage 1.
    spans = [
        Span("compute", 0, 10 * MS, 0, 0, 0, 8, 0, ("a",)),
        Span("compute", 10 * MS, 20 * MS, 1, 0, 0, 8, 0, ("a",)),
        Span("compute", 10 * MS, 20 * MS, 0, 0, 1, 0, 2, ("b", "c")),
        Span("compute", 25 * MS, 35 * MS, 1, 0, 1, 0, 2, ("b", "c")),
    ]
    path = tmp_path / "t.json"
    save_chrome_trace(path, spans, work_intervals=[(0, 35 * MS)])
    text = summary_text(path, "all")
    assert "per-request bubble: mean 3.333 ms, max 5.000 ms" in text
    assert "prefill 1, decode 1" in text
    assert "stage 0 tp 0 at 20.000 ms for 15.000 ms" in text


def test_png_and_html(gpipe_trace, tmp_path):
    png = render_png(gpipe_trace, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    page = render_html(gpipe_trace, tmp_path / "t.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    for j in range(6):
        assert f'data-step="{j}"' in page
    assert "microbatch 5" in page and "q5" in page and "tokens 4" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_jsonl_input_and_windows(tmp_path):
    path = tmp_path / "spans.jsonl"
    write_jsonl(path, gpipe(2, 3), [(0, 40 * MS)])
    run = load_run(path)
    assert run.work == [(0, 40 * MS)]
    assert parse_window("steady") == "steady"
    assert parse_window("10:25", run) == (10 * MS, 25 * MS)
    assert parse_window(":5") == (0, 5 * MS)
    # Window 10..30 ms of a 2-stage, 3-microbatch GPipe timeline (d = 10 ms): both stages busy.
    assert re.search(r"mean\s+100\.00%\s+0\.00%", summary_text(path, "10:30"))
    render_png(path, tmp_path / "w.png", window="5:25")
    for bad in ("later", "5", "30:10", "a:b", "-1:4"):
        with pytest.raises(ValueError):
            parse_window(bad, run)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        summary_text(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError):
        load_run(bad)


def test_compare(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_chrome_trace(a, gpipe(4, 6))
    # B: a shifted clock and a longer run; each is drawn relative to its own start.
    save_chrome_trace(b, [Span(s.kind, s.start_ns + 10**12, s.end_ns + 10**12, s.stage, 0, s.step_id, 0, 9)
                          for s in gpipe(4, 12)])
    png = render_compare(a, b, tmp_path / "cmp.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli(gpipe_trace, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    timeline_cli.add_parser(sub)
    out = tmp_path / "cli.png"
    args = parser.parse_args(["timeline", str(gpipe_trace), "-o", str(out), "--html",
                              str(tmp_path / "c.html"), "--compare", str(gpipe_trace)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "33.33%" in printed and out.exists() and (tmp_path / "c.html").exists()


def test_ppserve_cli_error_on_bad_window(gpipe_trace, capsys):
    from ppserve.cli import main

    assert main(["timeline", str(gpipe_trace), "--window", "nope", "--no-png"]) == 2
    assert "window 'nope'" in capsys.readouterr().err
    assert main(["timeline", "/nonexistent/trace.json", "--no-png"]) == 2


def test_speculated_microbatches_are_outlined_and_summarized(tmp_path):
    from ppserve.timeline import render

    spans = gpipe(2, 3)
    spans += [Span("schedule", 0, 1, -1, 0, 1, 0, 4, (), num_draft_tokens=6, num_accepted_tokens=4)]
    spans = [dataclasses.replace(s, num_draft_tokens=6) if s.kind == "compute" and s.step_id == 1 else s
             for s in spans]
    path = tmp_path / "spec.json"
    save_chrome_trace(path, spans)
    assert render.speculated_steps(load_run(path).spans) == {1: (6, 4)}
    assert "speculated microbatches: 1 of 3, 6 draft tokens; of the 6 whose results are in, 4 accepted" in (
        summary_text(path, "all"))
    page = render_html(path, tmp_path / "t.html").read_text()
    assert page.count('data-kind="speculated"') == 2 and "6 draft tokens, 4 accepted" in page

    def legend(run):
        fig, axes = render._figure(1, [2])
        render._draw_run(axes[0][0], axes[0][1], run, "all", "t")
        texts = [t.get_text() for t in axes[0][0].get_legend().get_texts()]
        render._plt().close(fig)
        return texts

    assert "speculated" in legend(load_run(path))
    plain = tmp_path / "plain.json"
    save_chrome_trace(plain, gpipe(2, 3))
    assert "speculated" not in legend(load_run(plain))
    assert "speculated micro" not in summary_text(plain, "all")
