"""Chrome / Perfetto trace export of the per-block timeline."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from dlo.observe.ledger import Interval

_TRACKS = {"copy": 1, "compute": 2}


def write_chrome_trace(path: str | Path, intervals: Iterable[Interval]) -> int:
    """Write `intervals` as complete ("X") events; returns how many were written.
    Open the file in chrome://tracing or ui.perfetto.dev."""
    events: list[dict] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": f"dlo {track}"}}
        for track, tid in _TRACKS.items()
    ]
    for interval in intervals:
        events.append(
            {
                "ph": "X",
                "name": interval.name,
                "cat": interval.track,
                "pid": 0,
                "tid": _TRACKS[interval.track],
                "ts": interval.start_s * 1e6,
                "dur": interval.duration_s * 1e6,
            }
        )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events) - len(_TRACKS)
