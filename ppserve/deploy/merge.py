"""The replicas' figures as one service's: Prometheus expositions and GetStats messages merged.

Expositions keep every replica's series apart by a `replica` label (added by the replica itself), so
the merge only regroups samples under one HELP/TYPE header per family, as the text format requires.
GetStats sums what adds up across replicas (requests, tokens, blocks, rates), recomputes the ratios
from the summed counts, averages the bubble fraction, and lists every replica's stages and workers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_exposition(text: str, name: str, value: str) -> str:
    """Every sample of a text exposition with one more label."""
    label = f'{name}="{_escape(value)}"'
    out = []
    for line in text.splitlines():
        m = None if line.startswith("#") else _SAMPLE.match(line)
        if m is None:
            out.append(line)
            continue
        metric, labels, rest = m.groups()
        inner = labels[1:-1] if labels else ""
        out.append(f"{metric}{{{label}{',' if inner else ''}{inner}}}{rest}")
    return "\n".join(out) + "\n"


def _family(sample_name: str, families: Mapping[str, Any]) -> str:
    """The family a sample belongs to (histograms and counters add suffixes to their family's name)."""
    if sample_name in families:
        return sample_name
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created", "_gcount", "_gsum"):
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in families:
            return sample_name[: -len(suffix)]
    return sample_name


def merge_expositions(texts: Sequence[str]) -> str:
    """One exposition holding every family once: its first header, then its samples from every text."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                fam = line.split()[2]
                seen = headers.setdefault(fam, [])
                samples.setdefault(fam, [])
                if len(seen) < 2 and not any(h.split()[1] == line.split()[1] for h in seen):
                    seen.append(line)
                continue
            if line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            fam = _family(m.group(1), headers) if m else ""
            samples.setdefault(fam, []).append(line)
    out: list[str] = []
    for fam, lines in samples.items():
        out.extend(headers.get(fam, ()))
        out.extend(lines)
    return "\n".join(out) + "\n"


_MAX = {"window_s", "uptime_s", "last_recovery_s"}
_MEAN = {"mean_bubble_fraction"}
_RATIOS = {"prefix_cache_hit_rate", "spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length"}


def merge_stats(replicas: Sequence[Any]) -> Any:
    """One pb.Stats from the replicas' (at least one)."""
    from ppserve.server.gen import ppserve_pb2 as pb

    if not replicas:
        raise ValueError("no replica answered")
    out = pb.Stats()
    out.config.CopyFrom(replicas[0].config)
    for field in pb.Stats.DESCRIPTOR.fields:
        name = field.name
        if field.message_type is not None:
            if field.is_repeated:
                for r in replicas:
                    getattr(out, name).extend(getattr(r, name))
            continue
        if name in _RATIOS:
            continue
        if field.is_repeated:
            sums: list[int] = []
            for r in replicas:
                for i, v in enumerate(getattr(r, name)):
                    sums.extend([0] * (i + 1 - len(sums)))
                    sums[i] += v
            getattr(out, name).extend(sums)
            continue
        values = [getattr(r, name) for r in replicas]
        if name in _MAX:
            setattr(out, name, max(values))
        elif name in _MEAN:
            setattr(out, name, sum(values) / len(values))
        else:
            setattr(out, name, sum(values))
    if out.prefix_cache_queries:
        out.prefix_cache_hit_rate = out.prefix_cache_hits / out.prefix_cache_queries
    accepted = out.spec_decode_num_accepted_tokens
    if out.spec_decode_num_draft_tokens:
        out.spec_decode_acceptance_rate = accepted / out.spec_decode_num_draft_tokens
    if out.spec_decode_num_drafts:
        out.spec_decode_mean_acceptance_length = 1 + accepted / out.spec_decode_num_drafts
    return out
