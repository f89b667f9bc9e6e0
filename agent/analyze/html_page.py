"""``rankwatch analyze --html``: the analysis as one self-contained HTML file.

:func:`render` turns the ``--json`` object into a page that fetches nothing: inline CSS, inline
SVG, no script, and a Content-Security-Policy that refuses every request.  It computes nothing
of its own: the heatmap is the object's ``heatmap`` (each rank's late arrival per step), the
stages its ``pipeline``, the what-if table its ``whatif``, and an incident's story is the text
``rankwatch diagnose`` prints (:func:`rankwatch.agent.views.story.tell`).  Every string from the
input goes through :func:`html.escape`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from rankwatch.agent.views.story import tell

__all__ = ["PALETTE", "render"]

PALETTE = ("#f7f7f2", "#fff3c4", "#ffe08a", "#ffc55c", "#fda13f", "#f67b30", "#e3502b", "#c22a2a", "#8e0d1e")
"""The heatmap's colours, from on time to the latest arrival of the job."""
_MISSING = "#d5d9de"
_MAX_WIDTH, _MAX_HEIGHT = 960.0, 720.0   # the heatmap's cells fit this many pixels, within limits
_LEFT, _TOP = 46.0, 18.0                 # room for the rank and step labels

_CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #1d2329; background: #f5f6f8; }
header { padding: .6em 1em; background: #1d2329; color: #fff; }
header h1 { font-size: 15px; margin: 0; display: inline; } header span { color: #9fb0c0; margin-left: 1em; }
main { padding: .6em 1em; display: grid; gap: .8em; }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 4px; padding: .6em .8em; overflow-x: auto; }
h2 { font-size: 13px; margin: 0 0 .4em; color: #4a5560; text-transform: uppercase; letter-spacing: .04em; }
.facts { display: flex; flex-wrap: wrap; gap: 1.6em; } .fact b { display: block; font-size: 18px; }
.fact span { color: #5f6b76; font-size: 11px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 1px 8px; text-align: right; }
td.name, th.name { text-align: left; font-family: ui-monospace, monospace; }
pre { white-space: pre-wrap; background: #f7f8fa; padding: .5em; margin: .3em 0; font-size: 12px; }
.legend { display: flex; gap: .8em; flex-wrap: wrap; font-size: 11px; margin: .3em 0; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }
.muted { color: #7b8690; } .bad { color: #c62828; } .ok { color: #2e7d32; }
svg text { font: 10px system-ui, sans-serif; fill: #4a5560; }
.k-hang, .k-rank_exit { color: #c62828; } .k-straggler { color: #b7791f; }
"""
_MEASURES = {"late_arrival": "Late arrival by rank and step",
             "own_excess": "Own work over its role's median, by rank and step (the trace names no collective groups)"}
_POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _secs(v: Any) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "–"
    return f"{v:.3f} s" if abs(v) >= 1 else f"{v * 1000:.1f} ms"


def _pct(v: Any) -> str:
    return f"{100 * v:.0f} %" if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def _fact(label: str, value: str) -> str:
    return f'<div class="fact"><b>{_e(value)}</b><span>{_e(label)}</span></div>'


def _section(title: str, body: str, ident: str) -> str:
    return f'<section id="{ident}"><h2>{_e(title)}</h2>{body}</section>'


def _late(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _level(v: float, top: float) -> int:
    """Which of :data:`PALETTE`'s colours ``v`` seconds of lateness gets (``top``: the job's most)."""
    if top <= 0 or v <= 0:
        return 0
    return min(len(PALETTE) - 1, 1 + int((len(PALETTE) - 1) * v / top * 0.999999))


def _legend(top: float) -> str:
    n = len(PALETTE) - 1
    items = [f'<span><span class="swatch" style="background:{PALETTE[0]}"></span>on time</span>']
    for i in range(1, n + 1):
        lo, hi = top * (i - 1) / n, top * i / n
        items.append(f'<span><span class="swatch" style="background:{PALETTE[i]}"></span>'
                     f'{_e(_secs(lo))} – {_e(_secs(hi))}</span>')
    items.append(f'<span><span class="swatch" style="background:{_MISSING}"></span>not recorded</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def _heatmap(heat: dict[str, Any] | None, flagged: dict[int, str]) -> str:
    """The rank x step grid of late arrival: one ``rect`` a cell with ``data-rank``,
    ``data-step`` and ``data-late`` (seconds), rank labels coloured by the rank's state."""
    ranks, steps = list((heat or {}).get("ranks") or []), list((heat or {}).get("steps") or [])
    rows = list((heat or {}).get("values") or (heat or {}).get("late") or [])
    if not ranks or not steps:
        return '<p class="muted">no late arrival was measured (no collective the ranks share)</p>'
    values = [[_late(v) for v in (rows[i] if i < len(rows) else [])] for i in range(len(ranks))]
    top = max((v for row in values for v in row if v is not None), default=0.0)
    w = max(3.0, min(18.0, _MAX_WIDTH / len(steps)))
    h = max(3.0, min(16.0, _MAX_HEIGHT / len(ranks)))
    out = []
    for i, rank in enumerate(ranks):
        y = _TOP + i * h
        for j, step in enumerate(steps):
            v = values[i][j] if j < len(values[i]) else None
            fill, late = (_MISSING, "") if v is None else (PALETTE[_level(v, top)], f"{v:.6g}")
            tip = f"rank {rank}, step {step}: " + ("not recorded" if v is None else f"{_secs(v)} late")
            out.append(f'<rect x="{_LEFT + j * w:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" '
                       f'data-rank="{_e(rank)}" data-step="{_e(step)}" data-late="{late}"><title>{_e(tip)}</title></rect>')
    out += _labels(ranks, steps, w, h, flagged)
    width, height = _LEFT + len(steps) * w + 4, _TOP + len(ranks) * h + 4
    svg = (f'<svg id="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.1f} {height:.1f}">' + "".join(out) + "</svg>")
    return _legend(top) + svg


def _labels(ranks: Sequence[Any], steps: Sequence[Any], w: float, h: float, flagged: dict[int, str]) -> list[str]:
    """Every k-th rank and step named, k so that labels do not overlap; a flagged rank always."""
    every_rank, every_step = max(1, math.ceil(12 / h)), max(1, math.ceil(28 / w))
    out = []
    for i, rank in enumerate(ranks):
        state = flagged.get(rank) if isinstance(rank, int) else None
        if i % every_rank == 0 or state:
            fill = ' style="fill:#c62828;font-weight:bold"' if state else ""
            out.append(f'<text x="{_LEFT - 4:.0f}" y="{_TOP + (i + 0.5) * h + 3.5:.1f}" text-anchor="end"{fill}>'
                       f'{_e(rank)}</text>')
    for j, step in enumerate(steps):
        if j % every_step == 0:
            out.append(f'<text x="{_LEFT + j * w:.1f}" y="{_TOP - 5:.0f}">{_e(step)}</text>')
    return out


def _stage_value(s: dict[str, Any], *keys: str) -> float:
    for k in keys:
        v = s.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return 0.0


def _pipeline(p: dict[str, Any] | None) -> str:
    """Per stage: its compute and its bubble (the share of its step it waits) as bars."""
    if not p or not p.get("stages"):
        return '<p class="muted">no pipeline stages in this job</p>'
    stages = p["stages"]
    longest = max(_stage_value(s, "step", "step_seconds") for s in stages) or 1.0
    bar, h = 520.0, 16.0
    out = []
    for i, s in enumerate(stages):
        compute, step = _stage_value(s, "compute", "compute_seconds"), _stage_value(s, "step", "step_seconds")
        bubble = _stage_value(s, "bubble") * step
        y = i * (h + 6)
        cw, bw = bar * compute / longest, bar * bubble / longest
        out.append(f'<text x="0" y="{y + 12:.0f}">stage {_e(s.get("stage"))}</text>'
                   f'<rect x="60" y="{y:.0f}" width="{cw:.1f}" height="{h:.0f}" fill="#1565c0" '
                   f'data-stage="{_e(s.get("stage"))}"><title>{_e(f"compute {_secs(compute)}")}</title></rect>'
                   f'<rect x="{60 + cw:.1f}" y="{y:.0f}" width="{bw:.1f}" height="{h:.0f}" fill="#f0b429">'
                   f'<title>{_e(f"bubble {_secs(bubble)}")}</title></rect>'
                   f'<text x="{66 + cw + bw:.1f}" y="{y + 12:.0f}">{_e(_secs(compute))} compute, '
                   f'{_e(_pct(s.get("bubble")))} bubble ({_e(s.get("ranks"))} ranks)</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{bar + 300:.0f}" height="{len(stages) * (h + 6):.0f}">'
           + "".join(out) + "</svg>")
    legend = ('<div class="legend"><span><span class="swatch" style="background:#1565c0"></span>compute</span>'
              '<span><span class="swatch" style="background:#f0b429"></span>bubble (waiting)</span></div>')
    return (f'<p>{_e(p.get("text", ""))}</p><p class="muted">imbalance {_e(_num(p.get("imbalance")))}x, '
            f'idle {_e(_pct(p.get("idle")))} of the step</p>' + legend + svg)


def _num(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def _whatif(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="muted">no what-if was replayed</p>'
    ranked = sorted(rows, key=lambda r: -r["speedup"] if isinstance(r.get("speedup"), (int, float)) else 0.0)
    body = "".join(f'<tr><td class="name">{_e(r.get("kind"))}</td><td class="name">{_e(r.get("what"))}</td>'
                   f'<td>{_e(_num(r.get("speedup")))}x</td></tr>' for r in ranked)
    return ('<table id="whatif-table"><tr><th class="name">set to its peers\' median</th><th class="name">what</th>'
            '<th>step-time speedup</th></tr>' + body + "</table>")


def _incidents(incidents: Sequence[dict[str, Any]]) -> str:
    """Each incident's one-line summary and its story, as ``rankwatch diagnose`` tells it."""
    if not incidents:
        return '<p class="muted">no incident: no straggler, hang or failure was found</p>'
    told = [{"node": "-", "rank": -1, "step": 0, "detected_at": None, **inc,
             "id": inc.get("id") or f"{inc.get('kind', 'incident')}-{n + 1}", "detail": inc.get("detail") or {}}
            for n, inc in enumerate(incidents)]
    out = []
    for inc in told:
        try:
            story = tell(inc, told)
        except (KeyError, TypeError, ValueError) as e:   # a shape the story does not know: show the raw fields
            story = f"(no story: {e!r})\n{inc}"
        where = f"rank {inc.get('rank')} on {inc.get('node')}, step {inc.get('step')}"
        out.append(f'<details open data-id="{_e(inc["id"])}"><summary><b class="k-{_e(inc.get("kind"))}">'
                   f'{_e(inc.get("kind"))}</b> {_e(where)}</summary><pre>{_e(story)}</pre></details>')
    return "".join(out)


def _findings(result: dict[str, Any]) -> str:
    b, wi, rp = result.get("bottleneck"), result.get("workload_imbalance"), result.get("replay") or {}
    facts = [_fact("ranks", str(result.get("ranks", "–"))), _fact("steps", str(result.get("steps", "–"))),
             _fact("step time (median)", _secs(result.get("step_seconds")))]
    facts.append(_fact("bottleneck", f"{b.get('kind')} {_pct(b.get('share'))}" if b else "–"))
    facts.append(_fact("workload imbalance (share of the step)", _pct(wi.get("share")) if wi else "none"))
    facts.append(_fact("replay error", _pct(rp.get("error")) if rp else "–"))
    out = '<div class="facts">' + "".join(facts) + "</div>"
    if b and isinstance(b.get("shares"), dict):
        out += "<p>step shares: " + _e(", ".join(f"{k} {_pct(v)}" for k, v in b["shares"].items())) + "</p>"
    if wi:
        more = {k: v for k, v in wi.items() if k != "share"}
        out += "<p>workload imbalance: " + _e(", ".join(f"{k} {_plain(v)}" for k, v in more.items())) + "</p>"
    if rp:
        cls = "ok" if rp.get("ok") else "bad"
        verb = "reproduces the measured step times within" if rp.get("ok") else "misses the measured step times by"
        note = rp.get("note") or (f"{verb} {_pct(rp.get('error'))}"
                                  + (f" over {rp['steps']} steps" if rp.get("steps") else ""))
        out += f'<p class="{cls}" id="replay-note">replay: {_e(note)}</p>'
    return out


def _dismissed(rows: Sequence[dict[str, Any]]) -> str:
    """The stragglers the replay showed to be another rank's consequence, with why."""
    if not rows:
        return ""
    items = "".join(f"<li>rank {_e(r.get('rank'))}: {_e(r.get('reason', ''))}</li>" for r in rows)
    return f"<p>not stragglers (the replay shows them to be a consequence):</p><ul>{items}</ul>"


def _plain(v: Any) -> str:
    return _num(v) if isinstance(v, float) else str(v)


def render(result: dict[str, Any]) -> str:
    """The ``analyze --json`` object as one HTML page that loads nothing from anywhere."""
    incidents = list(result.get("incidents") or [])
    flagged = {i["rank"]: "straggler" if i.get("kind") == "straggler" else "hung"
               for i in incidents if isinstance(i.get("rank"), int) and i.get("kind") in ("straggler", "hang")}
    heat = result.get("heatmap") or {}
    marked = ", ".join(f"rank {r} ({s})" for r, s in sorted(flagged.items()))
    parts = [
        _section("Findings", _findings(result), "findings"),
        _section(_MEASURES.get(heat.get("measure", ""), _MEASURES["late_arrival"]), _heatmap(heat, flagged)
                 + (f'<p>flagged: {_e(marked)}</p>' if marked else ""), "late"),
        _section("Pipeline stages", _pipeline(result.get("pipeline")), "pipeline"),
        _section("What if (replayed)", _whatif(result.get("whatif") or []), "whatif"),
        _section("Incidents", _incidents(incidents) + _dismissed(result.get("dismissed") or []), "incidents"),
    ]
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{_POLICY}">'
            f"<title>rankwatch analyze · {_e(result.get('source', ''))}</title><style>{_CSS}</style></head><body>"
            f"<header><h1>rankwatch analyze</h1><span>{_e(result.get('source', ''))}</span></header>"
            "<main>" + "".join(parts) + "</main></body></html>\n")
