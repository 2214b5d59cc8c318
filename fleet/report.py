"""The fleet's status as a table (plain text, or a ``rich`` table on a terminal) and as a chart.

One function makes the cells; the plain and the rich table only lay them out.
"""

from __future__ import annotations

import datetime
import io
import logging
from typing import Sequence

from common.files import write_bytes
from fleet.machines import (COMPLETED, FAILED, MISSING, STALLED, STOPPED, MachineFiles, MachineView,
                            parse_time, totals)

HEADER = ("machine", "state", "samples", "%", "shards", "tokens/s", "heartbeat")
COLOURS = {COMPLETED: "tab:green", FAILED: "tab:red", STALLED: "tab:orange", MISSING: "tab:gray",
           STOPPED: "tab:purple"}  # any other (running) state: blue
RICH_STYLES = {COMPLETED: "green", FAILED: "bold red", STALLED: "bold yellow", MISSING: "dim",
               STOPPED: "magenta"}


def duration(seconds: float | None) -> str:
    """``None`` -> ``-``; 75 -> ``1m15s``; 7500 -> ``2h05m``."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def cells(view: MachineView) -> tuple[str, ...]:
    total = "?" if view.samples_total is None else f"{view.samples_total:,}"
    fraction = view.fraction
    return (f"{view.machine_id:03d}", view.state.upper(), f"{view.samples_done:,}/{total}",
            "-" if fraction is None else f"{100 * fraction:.1f}", str(view.shards),
            f"{view.tokens_per_s:,.0f}" if view.tokens_per_s else "-",
            "-" if view.heartbeat_age_s is None else duration(view.heartbeat_age_s) + " ago")


def summary_line(views: Sequence[MachineView]) -> str:
    t = totals(views)
    total = "?" if t.samples_total is None else f"{t.samples_total:,}"
    percent = f" ({100 * t.samples_done / t.samples_total:.1f}%)" if t.samples_total else ""
    return (f"fleet: {t.completed}/{t.machines} machines completed, {t.samples_done:,}/{total} samples"
            f"{percent}, {t.shards} shards, {t.tokens_per_s:,.0f} tokens/s, ETA {duration(t.eta_s)}")


def plain_table(views: Sequence[MachineView]) -> str:
    rows = [HEADER] + [cells(v) for v in views]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.rjust(w) if i in (2, 3, 4, 5) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    errors = [f"  machine {v.machine_id:03d}: {v.error}" for v in views if v.error]
    return "\n".join(lines + errors + [summary_line(views)])


def rich_table(views: Sequence[MachineView]):
    from rich.table import Table
    table = Table(*HEADER, title=f"fleet status at {datetime.datetime.now():%H:%M:%S}",
                  caption=summary_line(views))
    for v in views:
        table.add_row(*cells(v), style=RICH_STYLES.get(v.state))
    return table


def samples_over_time(files: Sequence[MachineFiles]) -> tuple[list[float], list[int]]:
    """(time, fleet samples stored by then) at every stored shard, from the checkpoints' shard
    history (shards stored before ``stored_at`` existed are left out)."""
    events = sorted((parse_time(s["stored_at"]), s["total_samples_in_shard"])
                    for f in files if f.checkpoint for s in f.checkpoint.get("shards", [])
                    if s.get("stored_at"))
    times, counts, running = [], [], 0
    for at, count in events:
        running += count
        times.append(at)
        counts.append(running)
    return times, counts


def write_chart(views: Sequence[MachineView], files: Sequence[MachineFiles], path: str) -> None:
    """A PNG: one progress bar per machine coloured by state, and the fleet's stored samples
    over time."""
    import matplotlib
    matplotlib.use("Agg")  # no display: the chart is a file
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font cache notices
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.3 * len(views) + 1.5)))
    rows = range(len(views))
    bars.barh(rows, [100 * (v.fraction or 0.0) for v in views],
              color=[COLOURS.get(v.state, "tab:blue") for v in views])
    bars.set_yticks(rows, [f"{v.machine_id:03d}" for v in views])
    bars.set_xlim(0, 100)
    bars.invert_yaxis()
    bars.set_xlabel("samples done (%)")
    bars.set_title("progress per machine")
    states = dict.fromkeys(v.state for v in views)
    bars.legend(handles=[Patch(color=COLOURS.get(s, "tab:blue"), label=s) for s in states],
                loc="lower right", fontsize="small")
    times, counts = samples_over_time(files)
    if times:
        start = times[0]
        curve.step([0.0] + [(t - start) / 60 for t in times], [0] + counts, where="post")
    curve.set_xlabel("minutes since the first stored shard")
    curve.set_ylabel("samples stored (fleet)")
    curve.set_title("fleet progress")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    write_bytes(path, out.getvalue())
