"""Every timed verb carries its payload's bytes, its tensors passed by position or by keyword.

Real torch.distributed on gloo (one rank, in a spawned process so the wrappers
never touch this one).  The payload is the whole buffer, as nccl-tests count
it: an all-gather's output, a reduce-scatter's input, else the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp

N = 256  # float32 elements: 1 KiB
KIB = 4 * N


def _calls(dist, torch):
    """(verb, positional call, keyword call, expected bytes) for one rank."""
    t = lambda: torch.ones(N)  # noqa: E731
    return [
        ("all_reduce", lambda: dist.all_reduce(t()), lambda: dist.all_reduce(tensor=t()), KIB),
        ("all_gather", lambda: dist.all_gather([t()], t()),
         lambda: dist.all_gather(tensor_list=[t()], tensor=t()), KIB),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(t(), t()),
         lambda: dist.all_gather_into_tensor(output_tensor=t(), input_tensor=t()), KIB),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(t(), t()),
         lambda: dist.reduce_scatter_tensor(output=t(), input=t()), KIB),
        ("all_to_all_single", lambda: dist.all_to_all_single(t(), t()),
         lambda: dist.all_to_all_single(output=t(), input=t()), KIB),
        ("broadcast", lambda: dist.broadcast(t(), 0), lambda: dist.broadcast(tensor=t(), src=0), KIB),
        ("reduce", lambda: dist.reduce(t(), 0), lambda: dist.reduce(tensor=t(), dst=0), KIB),
        ("gather", lambda: dist.gather(t(), [t()], 0), lambda: dist.gather(tensor=t(), gather_list=[t()], dst=0), KIB),
        ("scatter", lambda: dist.scatter(t(), [t()], 0), lambda: dist.scatter(tensor=t(), scatter_list=[t()], src=0), KIB),
        ("barrier", lambda: dist.barrier(), lambda: dist.barrier(group=None), 0),
    ]


def _rank(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.recorder import Recorder

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    rec = Recorder()
    instr = CollectiveInstrumentation(rec)
    assert instr.install() == "python_wrappers"
    seen = {}
    for verb, positional, keyword, expected in _calls(dist, torch):
        got = []
        for call in (positional, keyword):
            rec.collectives.clear()
            try:
                call()
            except RuntimeError as exc:  # a verb this backend lacks is reported as such
                got.append(f"unsupported: {exc}"[:80])
                continue
            got.append([r[6] for r in rec.collectives])
        seen[verb] = {"expected": expected, "got": got}
    instr.uninstall()
    Path(out).write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_bytes_of_every_verb_both_ways(tmp_path):
    out = tmp_path / "seen.json"
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=1, join=True,
                       start_method="spawn")
    seen = json.loads(out.read_text())
    for verb, s in seen.items():
        positional, keyword = s["got"]
        assert positional == [s["expected"]], (verb, "positional", positional)
        assert keyword == [s["expected"]], (verb, "keyword", keyword)
