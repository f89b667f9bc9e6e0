"""Step-time overhead of rankwatch on a GPU-bound loop, instrumented as the README's own-loop example.

    python benchmarks/gpu_overhead.py [--steps 3000] [--block 20]

One process, one GPU, NCCL (world size 1, ``TORCH_NCCL_ENABLE_TIMING=1``): a
bf16 MLP whose step is GPU work (about 20 ms on an H100), its gradients
all-reduced each step as data parallelism would, streaming to a real agent.
The steps alternate in blocks between rankwatch on (``rankwatch.hooks.init``:
step scope, four marks, NCCL completion hooks, the sender thread) and off (a
``NullMonitor``, hooks standing by).  The first half of the run is an A/A
control: the blocks are labelled the same way but rankwatch stays on, so its
spread is the method's noise floor.  Each figure is the median over block pairs
of (median step on) / (median step off), each block's first step left out.

In the "off" blocks the sender thread still runs.  So the run also times
``--baseline`` steps before ``init()`` and as many after ``close()`` (the
sender stopped, the hooks standing by), and compares the "on" blocks with them.
``--device cpu`` runs the same loop on gloo with float32, to try the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess  # noqa: E402
from overhead import block_ratios, quantile  # noqa: E402

import rankwatch.hooks as rw  # noqa: E402


def _model(dim: int, layers: int, device: str) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, dim, bias=False), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=_dtype(device))


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="steps per half (A/A, then A/B)")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--baseline", type=int, default=500, help="steps without rankwatch, before and after")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        agent = AgentProcess(tmp / "agent.sock").start()
        try:
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                    store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1,
                                    **({"device_id": torch.device("cuda", 0)} if args.device == "cuda" else {}))
            _run(agent, args)
            dist.destroy_process_group()
        finally:
            agent.stop()


class _Loop:
    """The user's loop: one step of a bf16 MLP with data parallelism's gradient all-reduce."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = _model(args.dim, args.layers, args.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.dim, device=args.device, dtype=_dtype(args.device))
        self.tokens = float(args.batch)

    def step(self, m: object, n: int) -> float:
        t0 = time.perf_counter()
        with m.step(n, tokens=self.tokens):
            batch = self.x.clone(); m.mark("data")                              # noqa: E702
            loss = self.model(batch).float().pow(2).mean(); m.mark("forward")   # noqa: E702
            loss.backward(); m.mark("backward")                                 # noqa: E702
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
            self.opt.step(); self.opt.zero_grad(set_to_none=True); m.mark("optimizer")  # noqa: E702
            loss.item()
        return time.perf_counter() - t0


def _run(agent: AgentProcess, args: argparse.Namespace) -> None:
    loop, off = _Loop(args), rw.NullMonitor()
    before = [loop.step(off, n) for n in range(args.baseline + 50)][50:]  # 50 warm-up steps
    mon = rw.init(address=str(agent.addr))
    assert isinstance(mon, rw.Monitor), "rankwatch did not start"
    instr = mon._instr
    print(f"device {args.device}, collectives timed by {instr.source}", flush=True)
    on_steps: list[float] = []
    for control in (True, False):
        times, arms = [], []
        for i in range(args.steps):
            on = (i // args.block) % 2 == 0
            if not control and on != (instr.source != "none"):
                instr.install() if on else instr.uninstall()
            times.append(loop.step(mon if (on or control) else off, i + 1))
            arms.append(on)
        if instr.source == "none":
            instr.install()
        if not control:
            on_steps = [t for t, a in zip(times, arms) if a]
        r = block_ratios(times[args.block * 2:], arms[args.block * 2:], args.block)
        print(f"| {'A/A control' if control else 'A/B on/off'}, blocks of {args.block} | median step "
              f"{statistics.median(times) * 1e3:.2f} ms | ratio {statistics.median(r):.4f} (median of {len(r)} "
              f"block pairs; IQR {quantile(r, 0.25):.4f}-{quantile(r, 0.75):.4f}) |", flush=True)
    status = agent.status()
    mon.close()
    after = [loop.step(off, n) for n in range(args.baseline)]
    base = statistics.median(before + after)
    print(f"| on blocks / no rankwatch (before init, after close) | {statistics.median(on_steps) * 1e3:.3f} ms "
          f"vs {base * 1e3:.3f} ms (before {statistics.median(before) * 1e3:.3f}, after "
          f"{statistics.median(after) * 1e3:.3f}) | ratio {statistics.median(on_steps) / base:.4f} |")
    (rank,) = status["ranks"]
    print(f"agent saw step {rank['step']}, {rank['collectives']} collectives from "
          f"{rank['collective_source']}, dropped {rank['dropped']}")


if __name__ == "__main__":
    main()
