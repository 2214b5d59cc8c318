"""The fleet's status as a table (plain text, or a ``rich`` table on a terminal), a JSON
document and a chart, with each machine's usage and cost (``fleet/usage.py``).

``fleet_report`` gathers the figures once; one function makes the cells; the plain and the rich
table only lay them out. The chart's curves (``progress_curves``) are the fleet's samples computed
and stored over time since the launch: computed moves as the machines compute (a window of records
at a time), stored only as shards are stored (a small run may store everything at its end).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
from typing import Any, Sequence

from common.files import write_bytes
from fleet.machines import (COMPLETED, FAILED, MISSING, STALLED, STOPPED, UNDER_LIMIT, FleetTotals,
                            MachineFiles, MachineView, Point, computed_curve, parse_time, stored_curve,
                            totals)
from fleet.usage import FleetUsage, Ledger, MachineUsage, fleet_usage, machine_usage
from host.status import iso_time

HEADER = ("machine", "state", "samples", "%", "shards", "tokens/s", "heartbeat", "hours")
NUMERIC = {2, 3, 4, 5, 7, 8}  # right-aligned columns
COLOURS = {COMPLETED: "tab:green", FAILED: "tab:red", STALLED: "tab:orange", MISSING: "tab:gray",
           STOPPED: "tab:purple", UNDER_LIMIT: "tab:olive"}  # any other (running) state: blue
RICH_STYLES = {COMPLETED: "green", FAILED: "bold red", STALLED: "bold yellow", MISSING: "dim",
               STOPPED: "magenta", UNDER_LIMIT: "yellow"}
Since = tuple[float, int]  # (seconds since the chart's origin, samples)


@dataclasses.dataclass(frozen=True)
class FleetReport:
    """Everything ``status`` shows, at one moment."""
    at: float
    views: list[MachineView]
    files: list[MachineFiles]
    usage: dict[int, MachineUsage]
    totals: FleetTotals
    fleet: FleetUsage
    price_per_hour: float | None
    launched_at: float | None = None  # ``_fleet/fleet.json``'s (``read_launched_at``): the chart's origin


def fleet_report(views: Sequence[MachineView], files: Sequence[MachineFiles], ledger: Ledger, now: float,
                 price_per_hour: float | None, launched_at: float | None = None) -> FleetReport:
    usage = {v.machine_id: machine_usage(ledger, v.machine_id, now, price_per_hour) for v in views}
    fleet_totals = totals(views)
    return FleetReport(now, list(views), list(files), usage, fleet_totals,
                       fleet_usage(views, usage, price_per_hour, fleet_totals.eta_s), price_per_hour,
                       launched_at)


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


def money(amount: float | None) -> str:
    return "-" if amount is None else f"{amount:,.2f}"


def per_hour(tokens_per_hour: float | None) -> str:
    """Tokens per accelerator-hour, short: ``1.23M``."""
    if not tokens_per_hour:
        return "-"
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_hour >= size:
            return f"{tokens_per_hour / size:.2f}{unit}"
    return f"{tokens_per_hour:.0f}"


def header(report: FleetReport) -> tuple[str, ...]:
    return HEADER + (("cost",) if report.price_per_hour is not None else ())


def state_word(view: MachineView, usage: MachineUsage) -> str:
    return view.state.upper() + (" (released)" if view.state == COMPLETED and usage.released else "")


def cells(view: MachineView, usage: MachineUsage, priced: bool) -> tuple[str, ...]:
    total = "?" if view.samples_total is None else f"{view.samples_total:,}"
    fraction = view.fraction
    row = (f"{view.machine_id:03d}", state_word(view, usage), f"{view.samples_done:,}/{total}",
           "-" if fraction is None else f"{100 * fraction:.1f}", str(view.shards),
           f"{view.tokens_per_s:,.0f}" if view.tokens_per_s else "-",
           "-" if view.heartbeat_age_s is None else duration(view.heartbeat_age_s) + " ago",
           f"{usage.hours:.2f}")
    return row + ((money(usage.cost),) if priced else ())


def summary_line(report: FleetReport) -> str:
    t, u = report.totals, report.fleet
    total = "?" if t.samples_total is None else f"{t.samples_total:,}"
    percent = f" ({100 * t.samples_done / t.samples_total:.1f}%)" if t.samples_total else ""
    line = (f"fleet: {t.completed}/{t.machines} machines completed, {t.samples_done:,}/{total} samples"
            f"{percent}, {t.shards} shards, {t.tokens_per_s:,.0f} tokens/s, ETA {duration(t.eta_s)}")
    line += f"\nusage: {u.hours:.2f} accelerator-hours, {per_hour(u.tokens_per_hour)} tokens/accelerator-hour"
    if report.price_per_hour is not None:
        line += (f"; cost {money(u.cost)} so far, {money(u.projected_cost)} at completion "
                 f"(at {report.price_per_hour:g} per machine-hour)")
    return line


def plain_table(report: FleetReport) -> str:
    priced = report.price_per_hour is not None
    rows = [header(report)] + [cells(v, report.usage[v.machine_id], priced) for v in report.views]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in NUMERIC else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    errors = [f"  machine {v.machine_id:03d}: {v.error}" for v in report.views if v.error]
    return "\n".join(lines + errors + [summary_line(report)])


def rich_table(report: FleetReport):
    from rich.table import Table
    priced = report.price_per_hour is not None
    table = Table(*header(report), title=f"fleet status at {datetime.datetime.now():%H:%M:%S}",
                  caption=summary_line(report))
    for v in report.views:
        table.add_row(*cells(v, report.usage[v.machine_id], priced), style=RICH_STYLES.get(v.state))
    return table


def status_document(report: FleetReport) -> dict[str, Any]:
    """``status --json``: every figure of the table, unrounded, per machine and for the fleet."""
    machines = []
    for v in report.views:
        u = report.usage[v.machine_id]
        machines.append({
            "machine_id": v.machine_id, "state": v.state, "released": u.released,
            "samples_done": v.samples_done, "samples_total": v.samples_total, "shards": v.shards,
            "tokens_done": v.tokens_done, "tokens_per_s": v.tokens_per_s, "eta_s": v.eta_s,
            "heartbeat_age_s": v.heartbeat_age_s, "error": v.error,
            "accelerator_hours": u.hours, "active": u.active, "cost": u.cost,
            "tokens_per_accelerator_hour": v.tokens_done / u.hours if u.hours else None})
    t, f = report.totals, report.fleet
    fleet = {**dataclasses.asdict(t), "tokens_done": sum(v.tokens_done for v in report.views),
             "accelerator_hours": f.hours, "tokens_per_accelerator_hour": f.tokens_per_hour,
             "price_per_hour": report.price_per_hour, "cost": f.cost, "projected_cost": f.projected_cost}
    return {"at": iso_time(report.at), "machines": machines, "fleet": fleet}


def fleet_sum(curves: Sequence[Sequence[Point]]) -> list[Point]:
    """The machines' step curves summed at every time any of them changes, each machine's last
    value carried forward (0 before its first point)."""
    events = sorted((at, machine, count) for machine, curve in enumerate(curves) for at, count in curve)
    last, total, points = [0] * len(curves), 0, []
    for at, machine, count in events:
        total += count - last[machine]
        last[machine] = count
        if points and points[-1][0] == at:
            points[-1] = (at, total)
        else:
            points.append((at, total))
    return points


def progress_curves(files: Sequence[MachineFiles], launched_at: float | None) -> tuple[list[Since], list[Since]]:
    """The fleet's samples computed and stored over time: step curves of (seconds since the launch,
    samples), each from 0 at the launch (or at its first point, when that came before: an earlier
    launch's). Without a launch time the origin is the earliest time the files give."""
    computed = fleet_sum([computed_curve(f) for f in files])
    stored = fleet_sum([stored_curve(f) for f in files])
    origin = launched_at
    if origin is None:
        starts = [parse_time(f.status.get("started_at")) for f in files if f.status and f.status.get("started_at")]
        origin = min(starts + [curve[0][0] for curve in (computed, stored) if curve], default=0.0)
    return _from(computed, origin), _from(stored, origin)


def _from(curve: list[Point], origin: float) -> list[Since]:
    if not curve:
        return []
    shifted = [(at - origin, count) for at, count in curve]
    start = (min(0.0, shifted[0][0]), 0)
    return shifted if shifted[0] == start else [start] + shifted


def time_unit(span_s: float) -> tuple[float, str]:
    """The unit a time axis over ``span_s`` seconds reads best in: (its seconds, its name)."""
    if span_s <= 180:
        return 1.0, "seconds"
    return (60.0, "minutes") if span_s <= 180 * 60 else (3600.0, "hours")


def time_label(unit: str, launched_at: float | None) -> str:
    if launched_at is None:
        return f"{unit} since the fleet's first record (no launch record)"
    at = datetime.datetime.fromtimestamp(launched_at, datetime.timezone.utc)
    return f"{unit} since launch ({at:%Y-%m-%d %H:%M} UTC)"


def chart(report: FleetReport):
    """The figure: one progress bar per machine coloured by state, and the fleet's samples
    computed and stored over time since the launch; the usage (and cost) in the title."""
    import matplotlib
    matplotlib.use("Agg")  # no display: the chart is a file
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font cache notices
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    views, files = report.views, report.files
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
    computed, stored = progress_curves(files, report.launched_at)
    times = [at for at, _ in computed + stored]
    scale, unit = time_unit(max(times, default=0.0) - min(times, default=0.0))
    for points, label, colour in ((computed, "computed (status.json)", "tab:blue"),
                                  (stored, "stored (shards in checkpoints)", "tab:green")):
        if points:
            curve.step([at / scale for at, _ in points], [count for _, count in points], where="post",
                       label=label, color=colour)
    if report.totals.samples_total:
        curve.axhline(report.totals.samples_total, color="tab:gray", linestyle="--", label="all samples")
    if curve.get_lines():
        curve.legend(loc="upper left", fontsize="small")
    curve.set_xlabel(time_label(unit, report.launched_at))
    curve.set_ylabel("samples (fleet)")
    curve.set_title("fleet progress")
    fig.suptitle(summary_line(report).splitlines()[-1].removeprefix("usage: "), fontsize="medium")
    fig.tight_layout()
    return fig


def write_chart(report: FleetReport, path: str) -> None:
    """``chart`` as a PNG."""
    fig = chart(report)
    import matplotlib.pyplot as plt  # after ``chart`` chose the backend
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    write_bytes(path, out.getvalue())
