"""Write the Grafana dashboards in dashboards/grafana/ from the definitions below.

    python dashboards/generate.py            # rewrite the JSON files
    python dashboards/generate.py --check    # exit 1 if a JSON file is stale

The JSON is Grafana's classic dashboard model (schemaVersion 39).  Every panel
queries the data source picked in the ``datasource`` variable and filters on
the ``job`` (Prometheus scrape job), ``node`` and, for per-rank series,
``rank`` variables.  Job-wide fault-tolerance figures come from the
coordinator's agent, whichever node that is, so they are filtered on ``job``
only.  Edit this file, not the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "grafana"
SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}

# Label matchers, spliced into expressions.
J = 'job=~"$job"'
N = f'{J}, node=~"$node"'
R = f'{N}, rank=~"$rank"'
G = f'{N}, gpu=~"$gpu"'
RATE = "[$__rate_interval]"

Json = dict[str, Any]


@dataclass(frozen=True)
class Q:
    """One Prometheus query of a panel."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


@dataclass(frozen=True)
class P:
    """One panel.  ``kind`` is Grafana's panel type."""

    title: str
    kind: str
    queries: tuple[Q, ...]
    description: str
    unit: str = "short"
    w: int = 12
    h: int = 8
    min: float | None = None
    max: float | None = None
    stack: bool = False
    thresholds: tuple[tuple[float, str], ...] = ()
    mappings: tuple[tuple[int, str, str], ...] = ()  # (value, text, colour)
    no_value: str | None = None  # shown when the query returns nothing


@dataclass(frozen=True)
class Row:
    title: str


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    items: list[P | Row]
    variables: tuple[str, ...] = ("job", "node", "rank")
    annotations: list[Json] = field(default_factory=list)


# ---------------------------------------------------------------- template variables

_VARIABLE_QUERIES = {
    "job": "label_values(rankwatch_agent_info, job)",
    "node": 'label_values(rankwatch_agent_info{job=~"$job"}, node)',
    "rank": f"label_values(rankwatch_rank_step{{{N}}}, rank)",
    "gpu": f"label_values(rankwatch_gpu_info{{{N}}}, gpu)",
}
_VARIABLE_LABELS = {"job": "Scrape job", "node": "Node", "rank": "Rank", "gpu": "GPU"}


def _datasource_variable() -> Json:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [],
            "refresh": 1, "regex": "", "skipUrlSync": False}


def _query_variable(name: str) -> Json:
    query = _VARIABLE_QUERIES[name]
    return {"name": name, "label": _VARIABLE_LABELS[name], "type": "query", "datasource": DS,
            "definition": query,
            "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True, "options": [],
            "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 3}


# ---------------------------------------------------------------- panels

def _target(q: Q, ref: str) -> Json:
    return {"refId": ref, "datasource": DS, "editorMode": "code", "expr": q.expr,
            "legendFormat": q.legend or "__auto", "range": not q.instant, "instant": q.instant,
            "format": "table" if q.table else "time_series"}


def _field_config(p: P) -> Json:
    defaults: Json = {"unit": p.unit, "color": {"mode": "palette-classic"}}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.no_value is not None:
        defaults["noValue"] = p.no_value
    steps = [{"color": "green", "value": None}] + [{"color": c, "value": v} for v, c in p.thresholds]
    defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    if p.thresholds and p.kind in ("stat", "gauge", "bargauge"):
        defaults["color"] = {"mode": "thresholds"}
    if p.mappings:
        defaults["mappings"] = [{"type": "value", "options": {
            str(v): {"text": text, "color": colour, "index": i} for i, (v, text, colour) in enumerate(p.mappings)}}]
        defaults["color"] = {"mode": "thresholds"}
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if p.stack else 0,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
    return {"defaults": defaults, "overrides": []}


_REDUCE = {"calcs": ["lastNotNull"], "fields": "", "values": False}
_OPTIONS: dict[str, Json] = {
    "timeseries": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                              "calcs": ["lastNotNull", "max"]},
                   "tooltip": {"mode": "multi", "sort": "desc"}},
    "stat": {"reduceOptions": _REDUCE, "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
             "orientation": "auto", "textMode": "auto"},
    "gauge": {"reduceOptions": _REDUCE, "showThresholdLabels": False, "showThresholdMarkers": True},
    "bargauge": {"reduceOptions": _REDUCE, "displayMode": "gradient", "orientation": "horizontal",
                 "showUnfilled": True},
    "state-timeline": {"mergeValues": True, "showValue": "never", "alignValue": "left", "rowHeight": 0.9,
                       "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                       "tooltip": {"mode": "single", "sort": "none"}},
    "table": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
    "heatmap": {"calculate": False, "cellGap": 1, "rowsFrame": {"layout": "auto"},
                "yAxis": {"axisPlacement": "left"}, "legend": {"show": True},
                "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange", "steps": 64,
                          "exponent": 0.5, "reverse": False},
                "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                "cellValues": {"unit": "s"}},
}


def _panel(p: P, pid: int, x: int, y: int) -> Json:
    refs = "ABCDEFGH"
    out: Json = {"id": pid, "type": p.kind, "title": p.title, "description": p.description,
                 "datasource": DS, "gridPos": {"h": p.h, "w": p.w, "x": x, "y": y},
                 "fieldConfig": _field_config(p), "options": _OPTIONS[p.kind],
                 "targets": [_target(q, refs[i]) for i, q in enumerate(p.queries)]}
    if p.kind == "table":
        out["transformations"] = [{"id": "labelsToFields", "options": {}},
                                  {"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    return out


def _layout(items: list[P | Row]) -> list[Json]:
    """Place panels left to right, wrapping at Grafana's 24 columns; a row starts a new line."""
    panels: list[Json] = []
    x = y = line_h = 0
    for pid, item in enumerate(items, start=1):
        if isinstance(item, Row):
            y, x, line_h = y + line_h, 0, 0
            panels.append({"id": pid, "type": "row", "title": item.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y += 1
            continue
        if x + item.w > 24:
            y, x, line_h = y + line_h, 0, 0
        panels.append(_panel(item, pid, x, y))
        x, line_h = x + item.w, max(line_h, item.h)
    return panels


def render(d: Dashboard) -> Json:
    builtin = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
               "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
               "type": "dashboard"}
    return {
        "annotations": {"list": [builtin, *d.annotations]},
        "description": d.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"type": "dashboards", "title": "rankwatch", "tags": ["rankwatch"], "asDropdown": True,
                   "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False,
                   "tooltip": "", "url": ""}],
        "panels": _layout(d.items),
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["rankwatch"],
        "templating": {"list": [_datasource_variable(), *(_query_variable(v) for v in d.variables)]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": d.title,
        "uid": d.uid,
        "version": 1,
        "weekStart": "",
    }


def _annotation(name: str, expr: str, colour: str, title: str, tags: str) -> Json:
    return {"name": name, "datasource": DS, "enable": True, "hide": False, "iconColor": colour,
            "expr": expr, "step": "15s", "titleFormat": title, "tagKeys": tags, "textFormat": "",
            "useValueForTime": False}


def _hq(q: float, metric: str, by: str, sel: str, window: str = RATE) -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{sel}}}{window})))"


# ---------------------------------------------------------------- the dashboards

_RANK_STATE_CODES = (("ok", 0), ("straggler", 1), ("hung", 2), ("dead", 3), ("excluded", 4))
_RANK_STATE = "max by (node, rank) (\n  " + "\nor ".join(
    f'rankwatch_rank_state{{{R}, state="{s}"}} * {c}' for s, c in _RANK_STATE_CODES) + "\n)"
_RANK_STATE_MAPPINGS = ((0, "ok", "green"), (1, "straggler", "orange"), (2, "hung", "red"),
                        (3, "dead", "dark-red"), (4, "excluded", "purple"))

# Every incident kind, restarts and checkpoints included, marks the time it was raised.
_INCIDENTS = _annotation(
    "Incidents",
    f"sum by (node, kind) (rankwatch_incidents{{{N}}}) > sum by (node, kind) (rankwatch_incidents{{{N}}} offset 30s)",
    "red", "{{kind}} on {{node}}", "kind,node")



def _job_or_node(metric: str, by: str = "") -> str:
    """The coordinator's series of ``metric`` (scope job), else the node agents' (scope node)."""
    return f'{metric}{{{J}, scope="job"}} or on ({by}) {metric}{{{J}, scope="node"}}'


# The job's bottleneck: the coordinator's (scope job), else a lone node agent's (scope node).
_BOUND_SHARE = (f'rankwatch_bottleneck_share{{{J}, scope="job"}}'
                f' or on (kind) rankwatch_bottleneck_share{{{J}, scope="node"}}')
_BOUND_CODES = (("input", 0), ("communication", 1), ("compute", 2))
_BOUND_KIND = "max(\n  " + "\nor ".join(
    f'((rankwatch_bottleneck{{{J}, scope="job", kind="{k}"}} or on (kind) '
    f'rankwatch_bottleneck{{{J}, scope="node", kind="{k}"}}) == 1) * 0 + {c}' for k, c in _BOUND_CODES) + "\n)"
_BOUND_MAPPINGS = ((0, "input", "orange"), (1, "communication", "blue"), (2, "compute", "green"))

JOB = Dashboard(
    uid="rankwatch-job", title="rankwatch / Job overview",
    description="Throughput, MFU, goodput, restarts and checkpoints of the training job.",
    annotations=[_INCIDENTS],
    items=[
        Row("Now"),
        P("Step time", "stat", (Q(f"max(rankwatch_rank_step_seconds{{{R}}})"),),
          "Median wall time of the recent steps of the slowest rank: the job's step time.", "s", w=4, h=4),
        P("Tokens/s", "stat", (Q(f"sum(rankwatch_tokens_per_second{{{N}}})"),),
          "Tokens per second of the selected nodes (each rank counts its share).", "short", w=4, h=4),
        P("MFU", "gauge", (Q(f"avg(rankwatch_mfu_ratio{{{N}}})"),),
          "Model FLOPs utilisation, averaged over nodes. Only when every rank knows its peak "
          "(GPU table or --peak-tflops).", "percentunit", w=4, h=4, min=0, max=1),
        P("Goodput", "gauge", (Q(f"min(rankwatch_goodput_ratio{{{J}}})"),),
          "Productive time over elapsed time of the job so far.", "percentunit", w=4, h=4, min=0, max=1,
          thresholds=((0.0, "red"), (0.8, "orange"), (0.9, "green"))),
        P("Restart generation", "stat", (Q(f"max(rankwatch_restart_generation{{{J}}})"),),
          "How many times the job's workers were restarted.", "none", w=4, h=4),
        P("Excluded nodes", "stat", (Q(f"max(rankwatch_excluded_nodes{{{J}}})"),),
          "Nodes the coordinator currently keeps out of the job.", "none", w=4, h=4,
          thresholds=((1, "orange"),)),
        Row("Throughput"),
        P("Step time", "timeseries", (
            Q(f"max by (node) (rankwatch_rank_step_seconds{{{R}}})", "slowest rank on {{node}}"),
            Q(_hq(0.5, "rankwatch_step_duration_seconds", "le", N), "p50"),
            Q(_hq(0.99, "rankwatch_step_duration_seconds", "le", N), "p99")),
          "Per node, the slowest rank's median step time; p50 and p99 of every step on the selected nodes.", "s"),
        P("Tokens/s", "timeseries", (
            Q(f"sum by (node) (rankwatch_tokens_per_second{{{N}}})", "{{node}}"),
            Q(f"sum(rate(rankwatch_tokens_total{{{N}}}{RATE}))", "total")),
          "Tokens per second by node, and of the selection as a whole.", "short", min=0),
        P("MFU", "timeseries", (Q(f"rankwatch_mfu_ratio{{{N}}}", "{{node}}"),),
          "Model FLOPs utilisation per node.", "percentunit", min=0),
        P("Progress", "timeseries", (Q(f"max by (node) (rankwatch_rank_step{{{R}}})", "{{node}}"),),
          "Last step reached. A flat line while ranks are connected is a hang.", "none"),
        Row("Bottleneck"),
        P("What bounds the steps", "state-timeline", (Q(_BOUND_KIND, "bound by"),),
          "The kind that bounds the job's steps now: input (data wait), communication (collective "
          "wait the ranks that work the most cannot avoid) or compute (the rest). The coordinator's "
          "view of the job; a job of one node, its agent's. rankwatch status shows the same.",
          "none", w=8, mappings=_BOUND_MAPPINGS),
        P("Step make-up", "timeseries", (
            Q(f"max by (kind) ({_BOUND_SHARE})", "{{kind}}"),
            Q(f"avg(rankwatch_gpu_utilization_ratio{{{N}}})", "GPU utilisation")),
          "Each kind's share of the job's step (the three add up to 1), with the GPUs' mean utilisation: "
          "an input share that rises while the GPUs idle and the step slows is a job waiting for its "
          "data loaders on every rank (no straggler stands out; RankwatchJobInputBound).",
          "percentunit", w=16, min=0, max=1),
        Row("Pipeline stages and experts"),
        P("Stage compute", "timeseries", (Q(f"max by (stage) ({_job_or_node('rankwatch_pipeline_stage_compute_seconds', 'stage')})",
                                            "stage {{stage}}"),),
          "Each pipeline stage's median own work per step. Stages differ by design (the loss head, "
          "more layers): the heaviest sets the step, and the others wait in their receives.", "s", w=8, min=0),
        P("Stage bubbles", "timeseries", (Q(f"max by (stage) ({_job_or_node('rankwatch_pipeline_stage_bubble_ratio', 'stage')})",
                                            "stage {{stage}}"),),
          "The share of each stage's step it waits on the other stages (the schedule's bubbles); "
          "RankwatchPipelineStagesUneven.", "percentunit", w=8, min=0, max=1),
        P("Stage imbalance and expert skew", "timeseries", (
            Q(f"max({_job_or_node('rankwatch_pipeline_stage_imbalance_ratio')})", "heaviest stage / lightest"),
            Q(f"max({_job_or_node('rankwatch_expert_load_skew_ratio')})", "hottest experts' rank / mean")),
          "How uneven the work is by design: the heaviest pipeline stage's compute over the lightest's, "
          "and the tokens of the rank whose experts get the most over the ranks' mean (1 = even); "
          "RankwatchExpertLoadSkewed.", "none", w=8, min=0),
        Row("Fault tolerance"),
        P("Goodput", "timeseries", (Q(f"min(rankwatch_goodput_ratio{{{J}}})", "goodput"),),
          "Productive time over elapsed time, as the coordinator accounts for it.", "percentunit", min=0, max=1),
        P("Where the time goes", "timeseries", (
            Q(f"max by (kind) (rate(rankwatch_training_time_seconds_total{{{J}}}{RATE}))", "{{kind}}"),),
          "Share of wall time by kind: productive, hang, restart, recompute, checkpoint.",
          "percentunit", stack=True, min=0),
        P("Restarts", "timeseries", (Q(f"max by (reason) (rankwatch_restarts_total{{{J}}})", "{{reason}}"),),
          "Restarts since the coordinator started, by reason.", "none", min=0),
        P("Nodes", "timeseries", (
            Q(f"max by (state) (rankwatch_job_nodes{{{J}}})", "{{state}}"),
            Q(f"max by (reason) (rankwatch_exclusions_total{{{J}}})", "exclusions: {{reason}}")),
          "Nodes the coordinator knows, by state, and exclusions so far by reason.", "none", min=0),
        P("Last checkpoint", "stat", (
            Q(f"max(rankwatch_checkpoint_last_step{{{J}}})", "step"),
            Q(f"time() - max(rankwatch_checkpoint_last_timestamp_seconds{{{J}}})", "age (s)")),
          "Step and age in seconds of the last complete checkpoint.", "none", w=6),
        P("Checkpoint save time", "timeseries", (
            Q(_hq(0.5, "rankwatch_checkpoint_save_seconds", "le", J, "[10m]"), "p50"),
            Q(_hq(0.99, "rankwatch_checkpoint_save_seconds", "le", J, "[10m]"), "p99")),
          "Checkpoint save time over the last 10 minutes.", "s", w=6),
        P("Checkpoint requests", "timeseries", (
            Q(f"max by (reason) (rankwatch_checkpoint_requests_total{{{J}}})", "{{reason}}"),),
          "On-demand checkpoint requests, by reason.", "none", min=0),
        Row("Incidents"),
        P("Incidents held", "timeseries", (Q(f"sum by (kind) (rankwatch_incidents{{{N}}})", "{{kind}}"),),
          "Incidents the agents hold, by kind. Details: rankwatch diagnose.", "none", min=0),
        P("Ranks by state", "timeseries", (Q(f"sum by (state) (rankwatch_ranks{{{N}}})", "{{state}}"),),
          "The selected nodes' ranks by state.", "none", stack=True, min=0),
    ])

RANKS = Dashboard(
    uid="rankwatch-ranks", title="rankwatch / Ranks",
    description="Per-rank step time, phases, stragglers and collective latency.",
    annotations=[_INCIDENTS],
    items=[
        Row("Steps"),
        P("Step time by rank", "heatmap", (Q(f"rankwatch_rank_step_seconds{{{R}}}", "{{node}}/{{rank}}"),),
          "Median step time of each rank, one row per rank. In a synchronous job every row is alike; "
          "a straggler shows in own work below, not here.", "s", w=24),
        P("Rank state", "state-timeline", (Q(_RANK_STATE, "{{node}}/{{rank}}"),),
          "Each rank's state as the agent sees it.", "none", mappings=_RANK_STATE_MAPPINGS),
        P("Step reached", "timeseries", (Q(f"rankwatch_rank_step{{{R}}}", "{{node}}/{{rank}}"),),
          "Last step each rank reached.", "none"),
        Row("Phases"),
        P("Phase breakdown", "timeseries", (
            Q(f"avg by (phase) (rankwatch_rank_phase_seconds{{{R}}})", "{{phase}}"),),
          "The last step split into data, forward, backward, optimizer and other, averaged over ranks.",
          "s", stack=True, min=0),
        P("Phases by rank", "bargauge", (
            Q(f"rankwatch_rank_phase_seconds{{{R}}}", "{{node}}/{{rank}} {{phase}}", instant=True),),
          "Each rank's last step by phase.", "s", min=0),
        Row("Stragglers"),
        P("Straggler score", "timeseries", (
            Q(f"rankwatch_rank_straggler_slowdown_ratio{{{R}}}", "{{node}}/{{rank}}"),),
          "A rank's own work over the other ranks' median (1 = even). Flagged at 1.08 held for 24 steps.",
          "none", thresholds=((1.08, "red"),)),
        P("Straggler cause", "state-timeline", (Q(f"rankwatch_rank_straggler{{{R}}}", "{{node}}/{{rank}}: {{cause}}"),),
          "Ranks while flagged, with the cause: compute, data, communication, host or gpu_health.",
          "none", mappings=((1, "straggler", "orange"),)),
        P("Own work and collective wait", "timeseries", (
            Q(f"rankwatch_rank_own_work_seconds{{{R}}}", "own {{node}}/{{rank}}"),
            Q(f"rankwatch_rank_collective_wait_seconds{{{R}}}", "wait {{node}}/{{rank}}")),
          "Median per step. The straggler works longest and waits least.", "s", min=0),
        P("Straggler cost", "timeseries", (
            Q(f"max by (node) (rankwatch_straggler_cost_ratio{{{N}}})", "{{node}}"),),
          "Step-time speed-up if the current stragglers were gone (1 = none).", "none", min=1),
        Row("Collectives"),
        P("Collective latency p50", "timeseries", (
            Q(_hq(0.5, "rankwatch_collective_duration_seconds", "op, le", N), "{{op}}"),),
          "Median collective latency, issue to completion, by op.", "s", min=0),
        P("Collective latency p99", "timeseries", (
            Q(_hq(0.99, "rankwatch_collective_duration_seconds", "op, le", N), "{{op}}"),),
          "99th percentile collective latency by op.", "s", min=0),
        P("Collectives/s", "timeseries", (
            Q(f"sum by (op) (rate(rankwatch_rank_collectives_total{{{R}}}{RATE}))", "{{op}}"),),
          "Collectives completed per second by the selected ranks.", "ops", min=0),
        P("Collective throughput", "timeseries", (
            Q(f"sum by (op) (rate(rankwatch_collective_bytes_total{{{N}}}{RATE}))", "{{op}}"),),
          "Collective payload bytes per second.", "Bps", min=0),
        P("Collective sequence", "timeseries", (
            Q(f"rankwatch_rank_collective_sequence{{{R}}}", "{{node}}/{{rank}}"),),
          "Highest collective sequence number per rank. In a hang, the rank behind is the culprit.", "none"),
        Row("Processes"),
        P("Rank CPU", "timeseries", (
            Q(f"rate(rankwatch_rank_cpu_seconds_total{{{R}}}{RATE})", "{{node}}/{{rank}}"),),
          "CPU cores each rank's process uses.", "short", min=0),
        P("Rank memory", "timeseries", (Q(f"rankwatch_rank_resident_memory_bytes{{{R}}}", "{{node}}/{{rank}}"),),
          "Resident memory of each rank's process.", "bytes", min=0),
        P("Tokens/s by rank", "timeseries", (Q(f"rankwatch_rank_tokens_per_second{{{R}}}", "{{node}}/{{rank}}"),),
          "Each rank's share of tokens per second.", "short", min=0),
    ])

_THROTTLE_HW = "sw_thermal_slowdown|hw_thermal_slowdown|hw_slowdown|hw_power_brake_slowdown|sw_power_cap"

GPU = Dashboard(
    uid="rankwatch-gpu", title="rankwatch / GPU health",
    description="Temperature, power, clocks, throttling, ECC, row remapping, XIDs, NVLink and PCIe.",
    variables=("job", "node", "rank", "gpu"),
    items=[
        Row("Inventory"),
        P("Ranks and their devices", "table", (
            Q(f"rankwatch_rank_info{{{R}}}", instant=True, table=True),),
          "Which rank drives which device (local_rank, device, pid).", "none"),
        P("GPUs", "table", (Q(f"rankwatch_gpu_info{{{G}}}", instant=True, table=True),),
          "Each GPU's index, UUID, name and the source its figures come from.", "none"),
        P("GPU up", "state-timeline", (Q(f"rankwatch_gpu_up{{{G}}}", "{{node}} GPU {{gpu}}"),),
          "Down once a GPU fell off the bus or stopped answering.", "none",
          mappings=((1, "up", "green"), (0, "lost", "red")), w=24, h=6),
        Row("Thermals and power"),
        P("Temperature", "timeseries", (Q(f"rankwatch_gpu_temperature_celsius{{{G}}}", "{{node}} GPU {{gpu}}"),),
          "GPU core temperature.", "celsius", thresholds=((85, "red"),)),
        P("Power", "timeseries", (
            Q(f"rankwatch_gpu_power_watts{{{G}}}", "{{node}} GPU {{gpu}}"),
            Q(f"rankwatch_gpu_power_limit_watts{{{G}}}", "limit {{node}} GPU {{gpu}}")),
          "Power draw against the enforced limit.", "watt", min=0),
        P("SM clock", "timeseries", (Q(f"rankwatch_gpu_sm_clock_hertz{{{G}}}", "{{node}} GPU {{gpu}}"),),
          "Streaming multiprocessor clock. A drop with a throttle reason below is a slowdown.", "hertz", min=0),
        P("Memory clock", "timeseries", (Q(f"rankwatch_gpu_memory_clock_hertz{{{G}}}", "{{node}} GPU {{gpu}}"),),
          "Memory clock.", "hertz", min=0),
        P("Throttle reasons", "state-timeline", (
            Q(f'rankwatch_gpu_throttle{{{G}, reason!="gpu_idle"}} == 1', "{{node}} GPU {{gpu}} {{reason}}"),),
          "Active clock throttle reasons (idle left out).", "none", mappings=((1, "active", "orange"),), w=24),
        P("GPUs throttled for heat or power", "stat", (
            Q(f'count(max by (node, gpu) (rankwatch_gpu_throttle{{{G}, reason=~"{_THROTTLE_HW}"}}) == 1)'),),
          "GPUs with a thermal, hardware or power-cap slowdown active now.", "none", w=6, h=4,
          thresholds=((1, "orange"),), no_value="0"),
        Row("Utilisation and memory"),
        P("Utilisation", "timeseries", (
            Q(f"rankwatch_gpu_utilization_ratio{{{G}}}", "SM {{node}} GPU {{gpu}}"),
            Q(f"rankwatch_gpu_memory_utilization_ratio{{{G}}}", "memory {{node}} GPU {{gpu}}")),
          "Fraction of time a kernel ran, and memory controller busy fraction.", "percentunit", min=0, max=1),
        P("Memory", "timeseries", (
            Q(f"rankwatch_gpu_memory_used_bytes{{{G}}}", "used {{node}} GPU {{gpu}}"),
            Q(f"rankwatch_gpu_memory_total_bytes{{{G}}}", "total {{node}} GPU {{gpu}}")),
          "Framebuffer memory in use and in total.", "bytes", min=0),
        Row("Errors"),
        P("XID errors", "table", (Q(f"rankwatch_gpu_xid_errors_total{{{G}}}", instant=True, table=True),),
          "XID errors since the agent started, with the action they call for "
          "(reboot, reset_gpu, restart_app, ignore).", "none"),
        P("XID errors over time", "timeseries", (
            Q(f"sum by (node, gpu, xid, action) (rankwatch_gpu_xid_errors_total{{{G}}})",
              "{{node}} GPU {{gpu}} XID {{xid}} ({{action}})"),),
          "Cumulative XID errors; a step up marks when one happened.", "none", min=0),
        P("ECC errors (volatile)", "timeseries", (
            Q(f'sum by (node, gpu, severity) (increase(rankwatch_gpu_ecc_errors_total{{{G}, counter="volatile"}}{RATE}))',
              "{{severity}} {{node}} GPU {{gpu}}"),),
          "ECC errors since the last driver load, per interval. Any uncorrected one is fatal to the job.",
          "none", min=0),
        P("ECC errors (lifetime)", "bargauge", (
            Q(f'rankwatch_gpu_ecc_errors_total{{{G}, counter="aggregate"}}', "{{severity}} {{node}} GPU {{gpu}}",
              instant=True),),
          "ECC errors over the GPU's life.", "none", min=0),
        P("Remapped rows", "timeseries", (
            Q(f"rankwatch_gpu_remapped_rows{{{G}}}", "{{state}} {{node}} GPU {{gpu}}"),),
          "Rows remapped for correctable and uncorrectable errors, pending a reset, or failed. "
          "A failed remap means the GPU needs service.", "none", min=0),
        P("NVLink errors", "timeseries", (
            Q(f"sum by (node, gpu, type) (rate(rankwatch_gpu_nvlink_errors_total{{{G}}}{RATE}))",
              "{{type}} {{node}} GPU {{gpu}}"),),
          "NVLink CRC, replay and recovery errors per second, summed over links.", "short", min=0),
        P("PCIe replays", "timeseries", (
            Q(f"rate(rankwatch_gpu_pcie_replays_total{{{G}}}{RATE})", "{{node}} GPU {{gpu}}"),),
          "PCIe replays per second; a steady rate points at a bad link or riser.", "short", min=0),
    ])

AGENTS = Dashboard(
    uid="rankwatch-agents", title="rankwatch / Agents",
    description="Whether each agent is up, what it ingests and drops, and what it costs.",
    items=[
        Row("Agents"),
        P("Agent up", "state-timeline", (Q(f"up{{{J}}}", "{{instance}}"),),
          "Prometheus's scrape of each agent.", "none", mappings=((1, "up", "green"), (0, "down", "red"))),
        P("Agents", "table", (Q(f"rankwatch_agent_info{{{N}}}", instant=True, table=True),),
          "Version and node of each agent.", "none"),
        P("Coordinator", "state-timeline", (Q(f"rankwatch_coordinator{{{J}}}", "{{node}}"),),
          "Which agent coordinates the job.", "none",
          mappings=((1, "coordinator", "blue"), (0, "node agent", "transparent"))),
        P("Scrape duration", "timeseries", (Q(f"scrape_duration_seconds{{{J}}}", "{{instance}}"),),
          "How long Prometheus takes to scrape each agent.", "s", min=0),
        Row("Ingestion"),
        P("Records received", "timeseries", (
            Q(f"sum by (node, kind) (rate(rankwatch_records_received_total{{{N}}}{RATE}))", "{{node}} {{kind}}"),),
          "Records per second the agents take from their ranks.", "short", min=0),
        P("Messages rejected", "timeseries", (
            Q(f"sum by (node, reason) (rate(rankwatch_messages_rejected_total{{{N}}}{RATE}))",
              "{{node}} {{reason}}"),),
          "Messages refused per second, by reason. The sender's stream goes on.", "short", min=0),
        P("Records dropped", "timeseries", (
            Q(f"sum by (node) (rate(rankwatch_dropped_records_total{{{N}}}{RATE}))", "{{node}}"),),
          "Records the ranks dropped because the agent was away or slow.", "short", min=0),
        P("Records dropped by rank", "timeseries", (
            Q(f"increase(rankwatch_rank_dropped_records_total{{{R}}}{RATE})", "{{node}}/{{rank}}"),),
          "Records each rank dropped, per interval.", "short", min=0),
        P("Ranks connected", "timeseries", (
            Q(f"sum by (node) (rankwatch_rank_connected{{{R}}})", "{{node}}"),),
          "Ranks with an open stream to their agent.", "none", min=0),
        Row("Cost"),
        P("Agent CPU", "timeseries", (
            Q(f"rate(rankwatch_agent_cpu_seconds_total{{{N}}}{RATE})", "{{node}}"),),
          "CPU cores the agent uses.", "short", min=0),
        P("Agent memory", "timeseries", (Q(f"rankwatch_agent_resident_memory_bytes{{{N}}}", "{{node}}"),),
          "Agent resident memory.", "bytes", min=0),
        P("Host CPU", "timeseries", (
            Q(f"rankwatch_host_cpu_utilization_ratio{{{N}}}", "{{node}}"),
            Q(f"rankwatch_host_load1{{{N}}}", "load1 {{node}}")),
          "Node CPU utilisation and 1-minute load.", "short", min=0),
        P("Host memory", "timeseries", (
            Q(f"rankwatch_host_memory_used_bytes{{{N}}}", "used {{node}}"),
            Q(f"rankwatch_host_memory_total_bytes{{{N}}}", "total {{node}}")),
          "Node memory in use and in total.", "bytes", min=0),
    ])

DASHBOARDS = {"job.json": JOB, "ranks.json": RANKS, "gpu.json": GPU, "agents.json": AGENTS}


def dumps(d: Dashboard) -> str:
    return json.dumps(render(d), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a file differs, write nothing")
    args = p.parse_args(argv)
    stale = []
    for name, d in DASHBOARDS.items():
        path = OUT_DIR / name
        text = dumps(d)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for name in stale:
        print(f"stale: {OUT_DIR / name} (run python dashboards/generate.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
