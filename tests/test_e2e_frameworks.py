"""Frameworks nobody here wrote, under ``rankwatch run`` with no code change: the rank the
others wait for is the straggler, wherever in the step they wait for it.

``tests/data/lightning_job.py`` is a Lightning job (``strategy="ddp"``, launched by torchrun)
whose step logs its loss with ``sync_dist=True``: an all-reduce outside forward and backward.

``tests/data/hf_trainer.py`` is a Hugging Face Trainer job with the Trainer's defaults (a tiny
GPT-2 from a config, synthetic tokens, DDP on gloo).  By default the Trainer all-gathers each
batch's token count between fetching the batch and the forward, so the rank with the fast
loader waits there for the slow one.  That wait is a collective wait, not the fast rank's own
data time: counted as data, both ranks looked equally input-bound and no one was flagged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

DATA = Path(__file__).parent / "data"
SLOW_FROM = 50      # the slow rank's loader takes +60 ms a batch from this optimizer step on
STEPS = 150


def _run(agent, tmp_path: Path, script: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "n0",
           "--", "--standalone", "--nproc-per-node", "2", str(DATA / script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                              "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "zero-code instrumentation" not in out.stderr, out.stderr[-3000:]


def _one_data_straggler(status: dict) -> dict:
    """The run's only straggler incident, which must be rank 1's, for its data, within 40
    steps of its slow loader's start; no other rank is flagged."""
    stragglers = [i for i in status["incidents"] if i["kind"] == "straggler"]
    assert [(i["rank"], i["detail"]["cause"]) for i in stragglers] == [(1, "data")], stragglers
    assert stragglers[0]["step"] <= SLOW_FROM + 40, stragglers[0]
    return stragglers[0]


def test_lightning_s_slow_loader_is_the_data_straggler(agent_proc, tmp_path):
    count = tmp_path / "count"
    _run(agent_proc, tmp_path, "lightning_job.py", "--steps", str(STEPS), "--slow-loader", f"1:0.06:{SLOW_FROM}",
         "--count-out", str(count))
    assert [int(Path(f"{count}.{r}").read_text()) for r in (0, 1)] == [STEPS, STEPS]
    status = agent_proc.status()
    ranks = {r["rank"]: r for r in status["ranks"]}
    assert [ranks[r]["step"] for r in (0, 1)] == [STEPS, STEPS]   # Lightning's own count
    _one_data_straggler(status)
    # Rank 0 waits for rank 1 in DDP's gradient all-reduce and the logged loss's all-reduce.
    assert ranks[0]["collective_wait_seconds"] > 0.04 > ranks[1]["collective_wait_seconds"], ranks
    assert ranks[0]["phase_seconds"]["data"] < 0.02 < 0.04 < ranks[1]["phase_seconds"]["data"], ranks


def test_the_trainer_s_slow_loader_is_the_data_straggler_and_the_waiting_rank_is_not(agent_proc, tmp_path):
    count = tmp_path / "count"
    _run(agent_proc, tmp_path, "hf_trainer.py", "--steps", str(STEPS), "--slow-loader", f"1:0.06:{SLOW_FROM}",
         "--count-out", str(count), "--output-dir", str(tmp_path / "hf"))
    assert [int(Path(f"{count}.{r}").read_text()) for r in (0, 1)] == [STEPS, STEPS]
    status = agent_proc.status()
    ranks = {r["rank"]: r for r in status["ranks"]}
    assert [ranks[r]["step"] for r in (0, 1)] == [STEPS, STEPS]   # the Trainer's own count
    _one_data_straggler(status)
    # Rank 0 waits for rank 1 in the token-count all-gather before its forward: that time
    # is its collective wait, and its own data phase stays its own loader's few milliseconds.
    fast, slow = ranks[0], ranks[1]
    assert fast["op_latency"]["all_gather"]["count"] >= STEPS
    assert fast["phase_seconds"]["data"] < 0.02 < 0.04 < slow["phase_seconds"]["data"], (fast, slow)
    assert fast["collective_wait_seconds"] > 0.04 > slow["collective_wait_seconds"], (fast, slow)
    assert slow["own_work_seconds"] > 3 * fast["own_work_seconds"], (fast, slow)
