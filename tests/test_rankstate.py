"""A rank's state changes in one place: the table of rankstate.next_state, and nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rankwatch.agent.node.transitions import EVENTS, INITIAL, STATES, next_state

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("state,event,after", [
    ("ok", "hang", "hung"), ("straggler", "hang", "hung"), ("hung", "hang", "hung"),
    ("hung", "progressed", "ok"), ("ok", "progressed", "ok"), ("straggler", "progressed", "straggler"),
    ("ok", "flagged", "straggler"), ("straggler", "flagged", "straggler"),
    ("hung", "flagged", "hung"),          # the hang says more than the slowness
    ("straggler", "cleared", "ok"), ("hung", "cleared", "hung"), ("ok", "cleared", "ok"),
    ("ok", "exited", "dead"), ("straggler", "exited", "dead"), ("hung", "exited", "dead"),
    ("excluded", "exited", "excluded"),   # an excluded node's workers are stopped, not dead news
    ("dead", "hang", "dead"), ("dead", "progressed", "dead"), ("dead", "flagged", "dead"),
    ("dead", "excluded", "excluded"), ("hung", "excluded", "excluded"),
    ("excluded", "progressed", "excluded"), ("excluded", "flagged", "excluded"),
])
def test_transitions(state, event, after):
    assert next_state(state, event) == after


def test_every_pair_lands_on_a_known_state_and_final_states_stay_final():
    assert INITIAL in STATES
    for state in STATES:
        for event in EVENTS:
            after = next_state(state, event)
            assert after in STATES
            if state == "excluded":
                assert after == "excluded"
            if state == "dead":
                assert after in ("dead", "excluded")


def test_unknown_state_or_event_is_a_bug():
    with pytest.raises(ValueError, match="state"):
        next_state("sleepy", "hang")
    with pytest.raises(ValueError, match="event"):
        next_state("ok", "woke")  # type: ignore[arg-type]


def _state_writes(path: Path) -> list[tuple[int, str]]:
    """(line, source) of each assignment to an attribute ``.state`` not made through next_state."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if not (isinstance(t, ast.Attribute) and t.attr == "state"):
                continue
            if isinstance(t.value, ast.Name) and t.value.id == "self":
                continue  # an object's own state holder (Agent.state = NodeState(...)), not a rank's
            value = node.value
            through = (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                       and value.func.id == "next_state")
            if not through:
                bad.append((node.lineno, ast.get_source_segment(path.read_text(), node) or ""))
    return bad


def test_no_rank_state_is_written_outside_next_state():
    offenders = {str(p.relative_to(ROOT)): w for folder in ("agent", "hooks", "rankwatch")
                 for p in sorted((ROOT / folder).rglob("*.py")) if (w := _state_writes(p))}
    assert offenders == {}


def test_the_scan_finds_a_direct_write(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(r):\n    r.state = 'hung'\n    r.state = next_state(r.state, 'hang')\n")
    assert _state_writes(f) == [(2, "r.state = 'hung'")]
