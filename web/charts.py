"""The dashboard's pictures, drawn on the server: inline SVG and a calendar grid.

No script and no build step: a chart is an ``<svg>`` element the page embeds,
so it shows in any browser, in a screenshot and in a test that reads the DOM.
Each function takes plain numbers (what ``web.history`` reads from the farm)
and returns markup or rows; none reads Redis or the database.
"""

from __future__ import annotations

import datetime
import html
from typing import Iterable, Optional

from markupsafe import Markup

WIDTH, HEIGHT = 640, 130
PAD_LEFT, PAD_BOTTOM, PAD_TOP = 68, 18, 8  # room at the left for the top value and its unit
OK_COLOUR, BAD_COLOUR, LINE_COLOUR, GRID_COLOUR = "#17702f", "#b3261e", "#1f5fbf", "#ddd"


def _x(at: float, start: float, end: float) -> float:
    return PAD_LEFT + (WIDTH - PAD_LEFT - 4) * (at - start) / max(1e-9, end - start)


def _y(value: float, top: float) -> float:
    plot = HEIGHT - PAD_BOTTOM - PAD_TOP
    return PAD_TOP + plot * (1 - value / top) if top > 0 else HEIGHT - PAD_BOTTOM


def _frame(title: str, start: float, end: float, top: float, unit: str, ticks: int = 4) -> list[str]:
    """The axes: a few time labels below, the top value at the left."""
    parts = [f'<title>{html.escape(title)}</title>',
             f'<line x1="{PAD_LEFT}" y1="{HEIGHT - PAD_BOTTOM}" x2="{WIDTH - 4}" y2="{HEIGHT - PAD_BOTTOM}" '
             f'stroke="#999"/>',
             f'<line x1="{PAD_LEFT}" y1="{PAD_TOP}" x2="{WIDTH - 4}" y2="{PAD_TOP}" stroke="{GRID_COLOUR}"/>',
             f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 10}" text-anchor="end" font-size="10">'
             f'{html.escape(_number(top))} {html.escape(unit)}</text>',
             f'<text x="{PAD_LEFT - 4}" y="{HEIGHT - PAD_BOTTOM}" text-anchor="end" font-size="10">0</text>']
    span = end - start
    fmt = "%H:%M" if span <= 2 * 86400 else "%m-%d"
    for i in range(ticks + 1):
        at = start + span * i / ticks
        label = datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime(fmt)
        anchor = "start" if i == 0 else "end" if i == ticks else "middle"
        parts.append(f'<text x="{_x(at, start, end):.1f}" y="{HEIGHT - 4}" text-anchor="{anchor}" '
                     f'font-size="10">{label}</text>')
    return parts


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _svg(parts: list[str], css_class: str, label: str) -> Markup:
    body = "".join(parts)
    return Markup(f'<svg class="{css_class}" role="img" aria-label="{html.escape(label)}" '
                  f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}">{body}</svg>')


def latency_chart(points: Iterable[tuple[float, Optional[float]]], start: float, end: float, title: str) -> Markup:
    """A line of one value per bucket (ms; None: no jobs in it), a dot where a bucket stands alone."""
    points = [(at, value) for at, value in points if value is not None]
    top = max((value for _, value in points), default=0.0) * 1.1 or 1.0
    parts = _frame(title, start, end, top, "ms")
    run: list[str] = []
    for at, value in points:
        x, y = _x(at, start, end), _y(value, top)
        run.append(f"{x:.1f},{y:.1f}")
        parts.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{LINE_COLOUR}">'
                     f'<title>{_when(at)}: {value:.0f} ms</title></circle>')
    if len(run) > 1:
        parts.insert(5, f'<polyline fill="none" stroke="{LINE_COLOUR}" stroke-width="1.5" points="{" ".join(run)}"/>')
    if not points:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" font-size="12" fill="#777">'
                     'no jobs in this period</text>')
    return _svg(parts, "chart latency", title)


def uptime_chart(buckets: Iterable[tuple[float, int, int]], start: float, end: float, step: float,
                 title: str) -> Markup:
    """One bar per bucket: green for the probes that passed, red on top for those that failed."""
    buckets = [(at, ok, failed) for at, ok, failed in buckets if ok or failed]
    top = max((ok + failed for _, ok, failed in buckets), default=0) or 1
    parts = _frame(title, start, end, top, "probes")
    width = max(1.0, _x(start + step, start, end) - _x(start, start, end) - 1)
    for at, ok, failed in buckets:
        x = _x(at, start, end)
        base = HEIGHT - PAD_BOTTOM
        for count, colour, kind in ((ok, OK_COLOUR, "ok"), (failed, BAD_COLOUR, "failed")):
            if not count:
                continue
            height = HEIGHT - PAD_BOTTOM - _y(count, top)  # the count's own height, stacked on what is below
            parts.append(f'<rect class="bar {kind}" x="{x:.1f}" y="{base - height:.1f}" width="{width:.1f}" '
                         f'height="{height:.1f}" fill="{colour}"><title>{_when(at)}: {count} {kind}</title></rect>')
            base -= height
    if not buckets:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" font-size="12" fill="#777">'
                     'no probes in this period</text>')
    return _svg(parts, "chart uptime", title)


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --- the schedule as a calendar ------------------------------------------------------


def calendar(windows: Iterable[dict], now: float, weeks: int = 4) -> list[list[dict]]:
    """Weeks (Monday first, from this week) of days, each with the windows that
    touch it: ``{"date", "day", "today", "past", "windows": [{id, model, hours, state}]}``.
    A window over several days is listed on each, with that day's hours (UTC)."""
    today = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date()
    first = today - datetime.timedelta(days=today.weekday())
    windows = list(windows)
    rows = []
    for week in range(weeks):
        days = []
        for weekday in range(7):
            date = first + datetime.timedelta(days=week * 7 + weekday)
            begin = datetime.datetime(date.year, date.month, date.day, tzinfo=datetime.timezone.utc).timestamp()
            end = begin + 86400
            touching = []
            for window in sorted(windows, key=lambda w: (w["start"], w["id"])):
                if window["start"] < end and window["end"] > begin:
                    touching.append({"id": window["id"], "model": window["repo"], "state": window["state"],
                                     "hours": f"{_hour(max(window['start'], begin), begin)}-"
                                              f"{_hour(min(window['end'], end), begin)}"})
            days.append({"date": date.isoformat(), "day": date.day, "today": date == today, "past": date < today,
                         "windows": touching})
        rows.append(days)
    return rows


def _hour(at: float, day_start: float) -> str:
    if at - day_start >= 86400:
        return "24:00"
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%H:%M")
