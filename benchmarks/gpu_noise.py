"""Record step-time noise of a real one-GPU job, for the straggler replay (``replay.py``).

    python benchmarks/gpu_noise.py --steps 8000 --ranks 4 --out benchmarks/data/gpu_noise.npz \\
        --harness-args "--dim 512 --layers 4 ..."

One machine has one GPU, and NCCL will not put two ranks of a job on one
device.  So one rank trains (the harness, NCCL, rankwatch on and streaming to a
real agent), and its clean steps, after a warm-up, are cut into ``--ranks``
consecutive stretches that the replay treats as that many ranks of one job.
Stretches from different times share none of a real job's common noise, so
the replay sees more independent noise per rank than a real job would: a
pessimistic stand-in for false positives.  Own work is the step time (one rank
waits for no peer); data wait, collective wait and run delay are 0.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, torchrun  # noqa: E402
from noise import append_runs  # noqa: E402

WARMUP = 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--harness-args", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        agent = AgentProcess(tmp / "agent.sock").start()
        try:
            job = torchrun(1, "--steps", str(args.steps + WARMUP), "--log-every", "0",
                           "--metrics-out", str(tmp / "m"), *shlex.split(args.harness_args),
                           agent=agent.addr, log=tmp / "job.log", env={"TORCH_NCCL_ENABLE_TIMING": "1"})
            if job.wait(3600) != 0:
                raise RuntimeError((tmp / "job.log").read_text()[-3000:])
        finally:
            agent.stop()
        times = np.array(json.loads((tmp / "m" / "rank0.json").read_text())["step_times"][WARMUP:])
    per = len(times) // args.ranks
    own = times[: per * args.ranks].reshape(args.ranks, per)
    zeros = np.zeros_like(own)
    start = np.cumsum(own, axis=1) - own
    append_runs(args.out, [{"own": own.astype(np.float32), "data": zeros.astype(np.float32),
                            "wait": zeros.astype(np.float32), "delay": zeros.astype(np.float32),
                            "start": start}])
    q = np.percentile(times, [50, 90, 99])
    print(f"recorded {per * args.ranks} steps as {args.ranks} ranks x {per}: step median {q[0] * 1e3:.3f} ms, "
          f"p90 {q[1] * 1e3:.3f} ms, p99 {q[2] * 1e3:.3f} ms, CV {times.std() / times.mean():.4f}")


if __name__ == "__main__":
    main()
