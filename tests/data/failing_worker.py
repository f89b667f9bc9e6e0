"""A torchrun worker that fails on purpose (tests/test_e2e_failures.py), two ranks on gloo.

    failing_worker.py exit CODE     # no rankwatch import: rank 1 exits with CODE after 3 barriers
    failing_worker.py oom PROCS     # rank 1 joins the memory cgroup whose cgroup.procs is PROCS,
                                    # calls rankwatch.hooks.init(), then allocates until killed
"""

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    mode, arg = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mon = None
    if mode == "oom":
        if rank == 1:
            with open(arg, "w") as f:   # before the hello: the agent reads the rank's cgroup then
                f.write(str(os.getpid()))
        import rankwatch.hooks as rw

        mon = rw.init()
    hoard = []
    for step in range(1, 1000):
        if mon is not None:
            with mon.step(step):
                dist.barrier()
        else:
            dist.barrier()
        if rank == 1 and step == 3:
            if mode == "exit":
                sys.exit(int(arg))
            while True:   # the cgroup's limit ends this
                hoard.append(bytearray(16 << 20))
                hoard[-1][::4096] = b"x" * len(hoard[-1][::4096])
        time.sleep(0.05)


if __name__ == "__main__":
    main()
