"""Static checks of the Grafana dashboards in dashboards/grafana/.

Every query is also parsed by Prometheus's own parser (``promtool check rules``
on a rule file made of the queries), so a typo in PromQL fails here, not in a
browser.  tests/test_prometheus_stack.py runs the same queries against a real
Prometheus scraping real agents.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "dashboards" / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))

# The metrics contract's names that are being added with the operations issue and
# are not in the README's metric reference yet (stragglers, GPU health, fault tolerance).
CONTRACT_METRICS = {
    "rankwatch_rank_straggler", "rankwatch_straggler_cost_ratio",
    "rankwatch_gpu_info", "rankwatch_gpu_up", "rankwatch_gpu_temperature_celsius",
    "rankwatch_gpu_power_watts", "rankwatch_gpu_power_limit_watts", "rankwatch_gpu_sm_clock_hertz",
    "rankwatch_gpu_memory_clock_hertz", "rankwatch_gpu_utilization_ratio",
    "rankwatch_gpu_memory_utilization_ratio", "rankwatch_gpu_memory_used_bytes",
    "rankwatch_gpu_memory_total_bytes", "rankwatch_gpu_throttle", "rankwatch_gpu_ecc_errors_total",
    "rankwatch_gpu_remapped_rows", "rankwatch_gpu_pcie_replays_total", "rankwatch_gpu_nvlink_errors_total",
    "rankwatch_gpu_xid_errors_total",
    "rankwatch_goodput_ratio", "rankwatch_training_time_seconds_total", "rankwatch_restarts_total",
    "rankwatch_restart_generation", "rankwatch_excluded_nodes", "rankwatch_exclusions_total",
    "rankwatch_checkpoint_last_step", "rankwatch_checkpoint_last_timestamp_seconds",
    "rankwatch_checkpoint_save_seconds", "rankwatch_checkpoint_requests_total",
    "rankwatch_coordinator", "rankwatch_job_nodes",
}
# Series Prometheus itself attaches to every scrape target.
PROMETHEUS_METRICS = {"up", "scrape_duration_seconds"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Grafana's built-in variables, as a Prometheus scraping every second would see them.
GRAFANA_BUILTINS = {"__rate_interval": "5s", "__interval": "1s", "__range": "5m"}


def require_tool(name: str) -> str:
    """Path of a Prometheus binary; fails (never skips) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: install Debian's 'prometheus' package "
                    f"(apt-get install prometheus; .ci/apt-packages lists it)")
    return path


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dash: dict) -> Iterator[dict]:
    """Every panel, rows' collapsed children included; rows themselves are skipped."""
    for p in dash["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


def queries(dash: dict) -> Iterator[tuple[str, str]]:
    """``(where, expr)`` for every PromQL expression: panel targets and annotations."""
    for p in panels(dash):
        for t in p["targets"]:
            yield f'{dash["uid"]}: panel {p["id"]} "{p["title"]}" {t["refId"]}', t["expr"]
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            yield f'{dash["uid"]}: annotation "{a["name"]}"', a["expr"]


def variable_queries(dash: dict) -> Iterator[tuple[str, str, str]]:
    """``(name, metric selector, label)`` of each ``label_values(...)`` query variable."""
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert m, f'{dash["uid"]}: variable {v["name"]} is not label_values(selector, label)'
            yield v["name"], m.group(1), m.group(2)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$name`` and ``${name}`` by ``values[name]``, as Grafana does before querying."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def all_values(dash: dict) -> dict[str, str]:
    """Every template variable at its "All" value (``.*``), plus Grafana's built-ins."""
    return {**GRAFANA_BUILTINS, **{v["name"]: ".*" for v in dash["templating"]["list"] if v["type"] == "query"}}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label matchers, strings and functions left out)."""
    expr = re.sub(r"\{[^}]*\}|\"[^\"]*\"|\[[^\]]*\]", " ", expr)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {w for w in words if w.startswith("rankwatch_")} | (words & PROMETHEUS_METRICS)


def known_metrics() -> set[str]:
    """The metric reference (docs/metrics.md) plus the contract's names being added now."""
    page = (REPO / "docs" / "metrics.md").read_text()
    section = page.split("## Metric reference", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `rankwatch_")]
    documented = {name for cell in rows for name in re.findall(r"`(rankwatch_\w+)`", cell)}
    assert len(documented) > 20, "docs/metrics.md's metric reference table not found"
    return documented | CONTRACT_METRICS


def base_name(metric: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if metric.endswith(suffix):
            return metric[: -len(suffix)]
    return metric


def test_there_are_four_dashboards():
    assert {p.name for p in DASHBOARDS} == {"job.json", "ranks.json", "gpu.json", "agents.json"}


def test_json_is_generated_from_dashboards_generate_py():
    spec = importlib.util.spec_from_file_location("dashboards_generate", REPO / "dashboards" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, "run: python dashboards/generate.py"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_model_and_variables(path):
    dash = load(path)
    assert dash["schemaVersion"] >= 39
    assert dash["uid"].startswith("rankwatch-") and dash["title"].startswith("rankwatch / ")
    assert "rankwatch" in dash["tags"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("job", "node", "rank"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", name
        assert v["includeAll"] and v["allValue"] == ".*", name
    labels = {name: label for name, _, label in variable_queries(dash)}
    assert labels["job"] == "job" and labels["node"] == "node" and labels["rank"] == "rank"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels(path):
    dash = load(path)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    names = set(all_values(dash))
    for p in panels(dash):
        where = f'{path.name}: panel {p["id"]} "{p["title"]}"'
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["targets"], f"{where} has no query"
        assert p.get("description"), f"{where} has no description"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), where
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", where
            assert t["expr"].strip(), where
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= names, f"{where} uses undefined variables {used - names}"
            assert 'job=~"$job"' in t["expr"] or "$job" not in names, f"{where} ignores $job"
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, where


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_do_not_overlap(path):
    taken: set[tuple[int, int]] = set()
    for p in load(path)["panels"]:
        g = p["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f'{path.name}: panel {p["id"]} overlaps another'
        taken |= cells


def test_every_metric_is_in_the_contract():
    known = known_metrics()
    unknown = {}
    for path in DASHBOARDS:
        dash = load(path)
        exprs = [e for _, e in queries(dash)] + [sel for _, sel, _ in variable_queries(dash)]
        for expr in exprs:
            for metric in metric_names(expr):
                if metric not in PROMETHEUS_METRICS and base_name(metric) not in known:
                    unknown.setdefault(metric, path.name)
    assert not unknown, f"metrics not in docs/metrics.md or the contract: {unknown}"


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.5, sum by (op, le) (rate(rankwatch_collective_duration_seconds_bucket'
            '{job=~"$job", node=~"rankwatch_x"}[5m]))) / up')
    assert metric_names(expr) == {"rankwatch_collective_duration_seconds_bucket", "up"}


def test_every_query_parses_as_promql(tmp_path):
    """Prometheus's parser checks each query, as a recording rule in a throwaway rule file."""
    rules = []
    for path in DASHBOARDS:
        dash = load(path)
        values = all_values(dash)
        rules += [{"record": f"q:{len(rules)}", "expr": substitute(expr, values)} for _, expr in queries(dash)]
        rules += [{"record": f"q:{len(rules)}", "expr": f"group by ({label}) ({substitute(sel, values)})"}
                  for _, sel, label in variable_queries(dash)]
    assert len(rules) > 60
    f = tmp_path / "dashboard-queries.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([require_tool("promtool"), "check", "rules", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_broken_promql_is_caught(tmp_path):
    f = tmp_path / "bad.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "q:0", "expr": "sum by (node (rankwatch_rank_step)"}]}]}))
    out = subprocess.run([require_tool("promtool"), "check", "rules", str(f)], capture_output=True, text=True)
    assert out.returncode != 0
