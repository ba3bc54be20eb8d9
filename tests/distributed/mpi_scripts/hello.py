"""Started by a plain ``mpiexec -n 2 python hello.py OUT``: one all-reduce, rank 0 writes OUT/hello.txt."""

import sys

import asyncgrad as ag
from asyncgrad import distributed as dist


async def main(out: str) -> None:
    dist.init_process_group("mpi", timeout=30)
    t = ag.tensor([float(dist.get_rank() + 1)], dtype=ag.float64)
    await dist.all_reduce(t)
    if dist.get_rank() == 0:
        with open(f"{out}/hello.txt", "w") as f:
            f.write(f"{dist.get_world_size()} {t.item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    ag.run(main, sys.argv[1])
