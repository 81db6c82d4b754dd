"""A job for the launcher tests: `python launch_target.py MODE [TIMEOUT_S]`.

Every rank all-reduces six times; in "step 3" rank 1 fails as MODE says:
  finally  raises, then sleeps 600 s in a finally block (never leaves fn)
  thread   raises, and a non-daemon thread keeps its process alive 600 s
  exit     calls os._exit(3) without a word
  ok       does not fail
  linger   does not fail, but a non-daemon thread keeps rank 1 alive 600 s
           (the launcher waits LINGER_GRACE_S for it to exit, then kills it)
  save     every rank raises; in its finally block each waits SAVE_S (longer
           than the launcher's grace for a rank handling an exception), then
           all save together (an all-reduce) and say so
  retry    rank 1 catches the exception and backs off RETRY_S in its except
           block (shorter than the grace) while rank 0 waits, then goes on
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import sharc.launch
from sharc.launch import launch

LINGER_GRACE_S = 2.0
SAVE_S = 12.0  # > sharc.launch.DEFAULT_HANDLING_GRACE_S
RETRY_S = 7.0  # < sharc.launch.DEFAULT_HANDLING_GRACE_S


def step3(rank):
    raise RuntimeError(f"boom at step 3 on rank {rank}")


def fail_in_step3(rank, mode):
    if mode == "exit":
        os._exit(3)
    if mode in ("thread", "linger"):
        threading.Thread(target=time.sleep, args=(600,)).start()
    if mode == "retry":
        try:
            step3(rank)
        except RuntimeError:
            time.sleep(RETRY_S)  # a back-off before trying again
        return
    if mode not in ("ok", "linger"):
        step3(rank)


def job(mode):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    t = torch.ones(1)
    try:
        for step in range(6):
            if step == 3 and (rank == 1 or mode == "save"):
                fail_in_step3(rank, mode)
            dist.all_reduce(t)
    finally:
        if rank == 1 and mode == "finally":
            time.sleep(600)
        if mode == "save":
            time.sleep(SAVE_S)
            dist.all_reduce(t)
            print(f"saved on rank {rank}", flush=True)


if __name__ == "__main__":
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
    sharc.launch._EXIT_GRACE_S = LINGER_GRACE_S
    launch(job, 2, args=(sys.argv[1],), timeout=timeout)
    print("job finished")
