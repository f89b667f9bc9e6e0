"""Step-time overhead of full instrumentation, and of losing the agent mid-run.

    python benchmarks/overhead.py [--pairs 6] [--steps 80]
    python benchmarks/overhead.py --nproc 1 --tp 1 --nccl-timing --harness-args "--dim 512 ..."  # one GPU

The harness job (default 4 ranks, dp2 x tp2, gloo, CPU; ``--nproc``/``--tp``) runs in interleaved pairs:
rankwatch on (streaming to a live agent) and off (``--no-rankwatch``).  Each
run's figure is the median of its step times after a warm-up; the result is
the median over pairs of the on/off ratio.  Then, in the same way, runs whose
agent is SIGKILLed a third of the way through (and restarted 2 s later)
against undisturbed ones.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, torchrun  # noqa: E402

WARMUP = 10


SHAPE = {"nproc": 4, "tp": 2}
HARNESS: list[str] = []         # extra harness flags (--harness-args): the model's size on a GPU
ENV: dict[str, str] = {}        # extra job environment (--nccl-timing)


def run(tmp: Path, name: str, steps: int, agent: AgentProcess | None, *extra: str,
        during=None) -> float:
    out = tmp / name
    job = torchrun(SHAPE["nproc"], "--steps", str(steps), "--tp", str(SHAPE["tp"]),
                   "--metrics-out", str(out), *HARNESS,
                   "--log-every", "0", *extra, agent=agent.addr if agent else None,
                   log=tmp / f"{name}.log", env=ENV)
    if during:
        during()
    if job.wait(600) != 0:
        raise RuntimeError((tmp / f"{name}.log").read_text()[-2000:])
    medians = [statistics.median(json.loads((out / f"rank{r}.json").read_text())["step_times"][WARMUP:])
               for r in range(SHAPE["nproc"])]
    return statistics.median(medians)


def ab_job(tmp: Path, agent: AgentProcess, steps: int, block: int = 10, control: bool = False) -> None:
    """One job whose steps alternate in blocks between rankwatch on and off.

    With ``control``, the blocks are labelled the same way but rankwatch stays
    on throughout (an A/A test): its spread is the method's noise floor.
    """
    out = tmp / ("aa" if control else "ab")
    job = torchrun(SHAPE["nproc"], "--steps", str(steps), "--tp", str(SHAPE["tp"]),
                   "--metrics-out", str(out), *HARNESS, "--log-every", "0", "--ab-block", str(block),
                   agent=agent.addr, log=tmp / "ab.log",
                   env={**ENV, **({"RANKWATCH_AB_CONTROL": "1"} if control else {})})
    if job.wait(900) != 0:
        raise RuntimeError((tmp / "ab.log").read_text()[-2000:])
    ratios = []
    for r in range(SHAPE["nproc"]):
        d = json.loads((out / f"rank{r}.json").read_text())
        ratios += block_ratios(d["step_times"][block * 2:], d["rankwatch_on"][block * 2:], block)
    print(f"| in-job {'A/A control' if control else 'A/B'}, blocks of {block} steps | ratio on/off {statistics.median(ratios):.4f} "
          f"(median of {len(ratios)} block pairs over {SHAPE['nproc']} ranks; "
          f"IQR {quantile(ratios, 0.25):.3f}-{quantile(ratios, 0.75):.3f}) |", flush=True)


def block_ratios(times: list[float], arms: list[bool], block: int, whole: bool = False) -> list[float]:
    """Per pair of consecutive blocks (on, then off): the ratio of their median steps,
    each block's first step left out (it pays for the switch); ``whole``: of their wall
    times (the sums of all their steps), for loops whose single steps time only enqueueing."""
    blocks = [(arms[i], sum(times[i:i + block]) if whole else statistics.median(times[i + 1:i + block]))
              for i in range(0, len(times) - block + 1, block)]
    return [on / off for (a, on), (b, off) in zip(blocks[::2], blocks[1::2]) if a and not b]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--skip-failopen", action="store_true")
    ap.add_argument("--ab-steps", type=int, default=600,
                    help="steps of the in-job A/B run (blocks of 10 on, 10 off)")
    ap.add_argument("--ab-rounds", type=int, default=2, help="A/A and A/B job pairs")
    ap.add_argument("--harness-args", default="", help="extra harness flags, e.g. the model size")
    ap.add_argument("--nccl-timing", action="store_true",
                    help="TORCH_NCCL_ENABLE_TIMING=1: on NCCL, rankwatch times collectives on the GPU")
    ap.add_argument("--keep", type=Path, default=None,
                    help="copy each job's metrics (step times per rank) here")
    args = ap.parse_args()
    SHAPE.update(nproc=args.nproc, tp=args.tp)
    HARNESS[:] = shlex.split(args.harness_args)
    if args.nccl_timing:
        ENV["TORCH_NCCL_ENABLE_TIMING"] = "1"
    print(f"job: {args.nproc} ranks, tp {args.tp}, {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        agent = AgentProcess(tmp / "agent.sock").start()
        try:
            _main(tmp, agent, args)
        finally:
            agent.stop()
            if args.keep:
                for d in tmp.iterdir():
                    if d.is_dir() and not d.name.startswith("state"):
                        shutil.copytree(d, args.keep / d.name, dirs_exist_ok=True)


def _main(tmp: Path, agent: AgentProcess, args: argparse.Namespace) -> None:
    for _ in range(args.ab_rounds):
        ab_job(tmp, agent, args.ab_steps, control=True)
        ab_job(tmp, agent, args.ab_steps)
    ratios, on_t, off_t = [], [], []
    for i in range(args.pairs):
        a, b = (("on", "off") if i % 2 == 0 else ("off", "on"))  # alternate the order too
        t = {k: run(tmp, f"{k}{i}", args.steps, agent if k == "on" else None,
                    *(() if k == "on" else ("--no-rankwatch",))) for k in (a, b)}
        on_t.append(t["on"])
        off_t.append(t["off"])
        ratios.append(t["on"] / t["off"])
        print(f"pair {i}: on {t['on'] * 1e3:.2f} ms, off {t['off'] * 1e3:.2f} ms, "
              f"ratio {ratios[-1]:.4f}", flush=True)
    if not ratios:
        return
    print(f"| instrumentation on/off | median step {statistics.median(on_t) * 1e3:.2f} ms vs "
          f"{statistics.median(off_t) * 1e3:.2f} ms | ratio {statistics.median(ratios):.4f} "
          f"(median of {args.pairs} pairs) |")

    def kill_and_restart(tag: str):
        def during():
            time.sleep(3 + args.steps * 0.03)
            agent.kill()
            time.sleep(2)
            agent.log = tmp / f"agent-{tag}.log"
            agent.start()
        return during

    if args.skip_failopen:
        return
    fo = []
    for i in range(max(3, args.pairs // 2)):
        calm = run(tmp, f"calm{i}", args.steps, agent)
        hit = run(tmp, f"hit{i}", args.steps, agent, during=kill_and_restart(str(i)))
        fo.append(hit / calm)
        print(f"fail-open pair {i}: agent killed {hit * 1e3:.2f} ms, undisturbed "
              f"{calm * 1e3:.2f} ms, ratio {fo[-1]:.4f}", flush=True)
    print(f"| agent SIGKILLed mid-run / undisturbed | ratio {statistics.median(fo):.4f} "
          f"(median of {len(fo)} pairs) |")


if __name__ == "__main__":
    main()
