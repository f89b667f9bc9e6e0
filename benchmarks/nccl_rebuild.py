"""The in-process tier's NCCL path on one GPU: abort the communicators mid-step, recover in
process, and train on as an uninterrupted run does.

NCCL refuses two ranks of one job on one GPU, so on a one-GPU machine no survivor can lose
a peer.  This runs everything else a survivor does on NCCL, through the tier's own
``recover``: the communicators are aborted from another thread while a step's collectives
are in flight (what NCCL's watchdog does to a collective that timed out on a lost peer),
the training thread's error must read as a lost peer (``is_peer_failure``), then the
tier leaves the step (``abort_nccl``, the step commit's device gate), copies its shards
out, tears the groups down, makes a fresh NCCL group in the same process, rebuilds FSDP2
on the meta device, restores the shards and the fused AdamW state on the GPU, and trains
on.  Only the agreement is replaced, since with one rank nobody was lost: it returns the
one member, at the step the tier reports completed.

    torchrun --standalone --nproc-per-node 1 benchmarks/nccl_rebuild.py --out A.json
    torchrun --standalone --nproc-per-node 1 benchmarks/nccl_rebuild.py --abort-at 15 --out B.json
    python benchmarks/nccl_rebuild.py --compare A.json B.json

``--device cpu --fault raise`` runs the same on gloo (the fault then a raised peer error),
to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

LAYERS, BATCH = 6, 256


def _train(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rankwatch.hooks.recovery import net
    from rankwatch.hooks.recovery.inprocess import InProcessRecovery, Job, Membership, is_peer_failure
    from rankwatch.hooks.recovery.decide import Decision

    dev, DIM = args.device, args.dim
    if dev == "cuda":
        torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    fault_started = threading.Event()

    def make(membership: Membership) -> Job:
        mesh = init_device_mesh(dev, (dist.get_world_size(),), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        with torch.device("meta") if membership.generation else contextlib.nullcontext():
            model = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(LAYERS)],
                                  nn.Linear(DIM, 16))
        if not membership.generation:
            model.to(dev)
        for block in model[:-1]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if membership.generation:
            model.to_empty(device=dev)   # the tier copies the weights back from memory
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True if dev == "cuda" else None)
        return Job(model=model, optimizer=opt, replica_size=1, extra={"mesh": mesh})

    backend = "nccl" if dev == "cuda" else "gloo"
    tier = InProcessRecovery(make, backend=backend, total_steps=args.steps)
    job = tier.start()
    assert tier._round is not None, "no recovery store: run under torchrun"

    def agree_alone(old: Membership, completed: int, replica_size: int, ready: bool, settled: set) -> Decision:
        return Decision(ok=True, members=old.members, step=completed)

    tier._round.agree = agree_alone   # one rank: nobody to lose, so nobody to agree with

    def fault() -> None:
        for _ in range(len(pending)):
            fault_started.wait()
            fault_started.clear()
            net.abort_nccl()

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, DIM, generator=g), torch.randint(0, 16, (BATCH,), generator=g))
            for _ in range(args.steps)]
    losses: dict[int, float] = {}
    applied: list[int] = []
    report: dict = {"device": dev, "abort_at": args.abort_at, "fault": args.fault, "fault_in": args.fault_in}
    pending = set(args.abort_at)

    def at_fault_point(_module, _args):   # before the forward, or the last layer's backward
        if done in pending:
            pending.discard(done)
            if args.fault == "raise":
                raise RuntimeError("Connection reset by peer (scripted)")
            fault_started.set()
            time.sleep(0.05)   # the step's collectives in flight when the abort lands

    def hook(model):
        if args.fault_in == "forward":
            return model.register_forward_pre_hook(at_fault_point)
        return model[-1].register_full_backward_pre_hook(at_fault_point)

    hooks = [hook(job.model)]
    if pending and args.fault == "abort":
        threading.Thread(target=fault, daemon=True).start()
    done = tier.completed
    step_times = []
    while done < args.steps:
        try:
            t = time.perf_counter()
            x, y = data[done]
            loss = F.cross_entropy(job.model(x.to(dev)), y.to(dev))
            loss.backward()
            step_loss = loss.detach().reshape(1).clone()
            carried = tier.carry(step_loss)
            job.optimizer.step()
            job.optimizer.zero_grad()
            if not carried:
                dist.all_reduce(step_loss)
            done += 1
            losses[done] = step_loss.item()
            applied.append(done)
            step_times.append(time.perf_counter() - t)
            if (phases := tier.stepped(done)) is not None:
                report.setdefault("phases", []).append(phases)
        except Exception as exc:  # noqa: BLE001 - recover() re-raises what is not a lost peer
            failure = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                       "is_peer_failure": is_peer_failure(exc), "failed_after": done}
            job, done = tier.recover(exc, job, completed=done)
            hooks.append(hook(job.model))
            report.setdefault("failures", []).append({**failure, "resumed_from": done})
            for s in [s for s in losses if s > done]:   # steps the device skipped are trained again
                del losses[s]
    tier.finish(done)
    digest = hashlib.sha1()
    for p in job.model.parameters():
        digest.update(p.detach().full_tensor().cpu().numpy().tobytes())
    report.update(losses={str(k): v for k, v in sorted(losses.items())}, applied=applied, digest=digest.hexdigest(),
                  world_size=dist.get_world_size(), generation=tier.membership.generation,
                  step_ms_median=1e3 * sorted(step_times)[len(step_times) // 2],
                  nccl_error_handling=os.environ.get(net.ASYNC_ERROR_HANDLING))
    if dev == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    report["torch"] = torch.__version__
    dist.destroy_process_group()
    return report


def _compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    same_losses = a["losses"] == b["losses"]
    steps = sorted(int(s) for s in b["losses"])
    fails = b.get("failures", [])
    rows = [
        ("device, torch, NCCL", f"{b.get('gpu', b['device'])}, {b['torch']}, {b.get('nccl', '-')}"),
        ("the training thread's errors", "; ".join(f["error"] for f in fails) or "none"),
        ("each read as a lost peer", [f["is_peer_failure"] for f in fails]),
        ("failed after step, resumed from", [(f["failed_after"], f["resumed_from"]) for f in fails]),
        ("generation at the end", b["generation"]),
        ("steps applied (a step the device skipped is trained again)", f"{len(b['applied'])} for {len(steps)}"),
        ("every step's loss equals the uninterrupted run's", same_losses),
        ("parameters equal bit for bit", a["digest"] == b["digest"]),
        *[(f"recovery {i + 1} phases, s", ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
          for i, ph in enumerate(b.get("phases", []))],
        ("step time, median ms (uninterrupted, recovered)", f"{a['step_ms_median']:.2f}, {b['step_ms_median']:.2f}"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", b["nccl_error_handling"]),
    ]
    print("| | |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    if not same_losses:
        diff = [s for s in a["losses"] if a["losses"][s] != b["losses"].get(s)]
        print("losses differ at steps", diff[:10])
    ok = (same_losses and a["digest"] == b["digest"] and len(b.get("phases", [])) == len(b["abort_at"]) == len(fails)
          and all(f["is_peer_failure"] for f in fails) and steps == list(range(1, len(steps) + 1)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--abort-at", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="fault during the step after each of these (comma-separated)")
    p.add_argument("--fault", choices=("abort", "raise"), default="abort")
    p.add_argument("--fault-in", choices=("forward", "backward"), default="forward")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--out", type=Path)
    p.add_argument("--compare", nargs=2, type=Path, metavar=("UNINTERRUPTED", "RECOVERED"))
    args = p.parse_args()
    if args.compare:
        return _compare(*args.compare)
    report = _train(args)
    text = json.dumps(report)
    if args.out:
        args.out.write_text(text)
    print({k: v for k, v in report.items() if k not in ("losses", "applied")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
