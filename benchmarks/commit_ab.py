"""The in-process tier's per-step cost within one run: blocks of steps with its commit on and off.

Run as a torchrun entry point in place of ``rankwatch.hooks.train``, with
``--in-process-recovery`` and the harness's other arguments, plus ``--ab-out DIR`` and
``--ab-steps N``.  Blocks of N optimizer steps alternate between two arms:

* **on**: the tier's step commit before each optimizer step, with the harness's loss for
  the log carried in it (as the harness runs under the tier);
* **off**: no commit, and the loss summed in an all-reduce of its own after the step (as
  the harness runs without the tier).

Every rank switches at the same step (the arm follows the count of optimizer steps), so
the collectives match.  Both arms run in the same processes in the same minutes: the
machine's drift, which spreads run-to-run ratios over ±5 % here, falls on both alike.
What the two arms share is not measured: the tier's background work (rank 0's look for
joiners in the store every 0.5 s, the liveness listener) and its ~80 ns per step in
``tier.stepped``.  ``--ab-own-reduce``: the "on" arm sums the loss in its own all-reduce
too (the tier's cost before the loss rode in the commit).  ``--ab-aa``: both arms "off"
(the A/A control).

Writes ``DIR/ab<rank>.json``: each step's arm (true: on), in step order; the harness's
``--metrics-out`` has the step starts.  Used by ``inprocess_overhead.py --ab-runs``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rankwatch.hooks.recovery import commit
from rankwatch.hooks.train import main

_agree, _carry = commit.StepCommit._agree, commit.StepCommit.carry
block = 10
own_reduce = aa = False
arms: list[bool] = []   # the arm of each optimizer step, in order


def _on(step_index: int) -> bool:
    return not aa and (step_index // block) % 2 == 0


def _agree_by_arm(self: Any, *args: Any) -> None:
    on = _on(len(arms))
    arms.append(on)
    if on:
        _agree(self, *args)
    else:
        self._carried = None   # off: no commit, and nothing was carried (see _carry_by_arm)


def _carry_by_arm(self: Any, values: Any) -> bool:
    if own_reduce or not _on(len(arms)):
        return False           # the harness sums its loss itself
    return _carry(self, values)


def _take(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


if __name__ == "__main__":
    argv = sys.argv[1:]
    out = Path(_take(argv, "--ab-out") or ".")
    block = int(_take(argv, "--ab-steps") or block)
    for flag in ("--ab-own-reduce", "--ab-aa"):
        if flag in argv:
            argv.remove(flag)
            own_reduce, aa = own_reduce or flag == "--ab-own-reduce", aa or flag == "--ab-aa"
    commit.StepCommit._agree = _agree_by_arm
    commit.StepCommit.carry = _carry_by_arm
    rc = main(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ab{os.environ.get('RANK', '0')}.json").write_text(json.dumps(arms))
    sys.exit(rc)
