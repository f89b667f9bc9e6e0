"""The Prometheus alert rules in dashboards/prometheus/: promtool checks and unit tests.

``promtool`` comes from Debian's ``prometheus`` package (.ci/apt-packages).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from test_dashboards import require_tool

REPO = Path(__file__).resolve().parents[1]
RULES_DIR = REPO / "dashboards" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
UNIT_TESTS = RULES_DIR / "alerts_test.yml"
README = REPO / "dashboards" / "README.md"
SEVERITIES = {"critical", "warning", "info"}


def alert_rules() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def unit_cases() -> list[dict]:
    return [case for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in t["alert_rule_test"]]


def promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_check_rules():
    out = promtool("check", "rules", RULES.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


def test_promtool_unit_tests_pass():
    out = promtool("test", "rules", UNIT_TESTS.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_wrong_expectation_fails(tmp_path):
    """The unit tests can fail: expect the straggler alert with the wrong cause and promtool objects."""
    shutil.copy(RULES, tmp_path / RULES.name)
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    doc["tests"] = [t for t in doc["tests"]
                    if any(c["alertname"] == "RankwatchStragglerDetected" for c in t["alert_rule_test"])]
    firing = [a for t in doc["tests"] for c in t["alert_rule_test"] for a in c["exp_alerts"]]
    assert firing
    firing[0]["exp_labels"]["cause"] = "data"
    (tmp_path / UNIT_TESTS.name).write_text(yaml.safe_dump(doc))
    out = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert out.returncode != 0 and "RankwatchStragglerDetected" in out.stdout + out.stderr


def test_the_required_alerts_exist():
    required = {
        "RankwatchThroughputDegraded", "RankwatchStragglerDetected", "RankwatchTrainingHang",
        "RankwatchNoStepProgress", "RankwatchGPUFatalXid", "RankwatchGPUThermalThrottling",
        "RankwatchGPUPowerThrottling", "RankwatchGPUUncorrectableECC", "RankwatchGPURowRemapFailed",
        "RankwatchCheckpointStale", "RankwatchNodeExcluded", "RankwatchRestartStorm",
        "RankwatchAgentDown", "RankwatchRecordsDropped", "RankwatchGoodputLow",
    }
    assert required <= set(alert_rules())


def test_every_alert_has_a_firing_and_a_quiet_case():
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in unit_cases():
        (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    rules = set(alert_rules())
    assert rules - firing == set(), "alerts without a firing test case"
    assert rules - quiet == set(), "alerts without a non-firing test case"
    assert (firing | quiet) <= rules, "test cases for alerts that do not exist"


def test_firing_cases_keep_the_job_label():
    """Alertmanager routes on job; every aggregation must keep it."""
    for case in unit_cases():
        for alert in case.get("exp_alerts") or []:
            assert "job" in alert["exp_labels"], f'{case["alertname"]} drops the job label'


@pytest.mark.parametrize("name", sorted(alert_rules()))
def test_labels_annotations_and_runbook(name):
    rule = alert_rules()[name]
    assert rule["labels"]["severity"] in SEVERITIES
    notes = rule["annotations"]
    for key in ("summary", "description", "runbook"):
        assert notes.get(key, "").strip(), f"{name}: annotation {key} missing"
    assert len(notes["runbook"]) > 120, f"{name}: the runbook should say concretely what to do"
    anchor = f"dashboards/README.md#{name.lower()}"
    assert anchor in notes["runbook"], f"{name}: runbook does not point at {anchor}"
    headings = {h.strip().lower() for h in re.findall(r"^#+ (.+)$", README.read_text(), re.M)}
    assert name.lower() in headings, f"dashboards/README.md has no '### {name}' section"
