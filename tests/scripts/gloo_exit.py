"""Collectives on the world and a subgroup over gloo, then exit without ``destroy_process_group``.

Two ways a gloo rank failed to exit, both handled by ``destroy_gloo_groups_at_exit``:
- it aborts at interpreter exit in about 8 runs out of 10 on 5 ranks without the hook ("terminate called without
  an active exception", pytorch/pytorch#190489);
- it never exits, every time, when the hook frees the world group through a DDP reducer inside ``gc.collect``
  while a collective is still running (here one left in flight while the last rank is late): the group's destructor
  holds the GIL and joins the gloo worker, which waits for the GIL to free the finished work's tensor.
"""

import time

import torch
import torch.distributed as dist
from torch import nn

from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit

dist.init_process_group("gloo")
destroy_gloo_groups_at_exit()
world, rank = dist.get_world_size(), dist.get_rank()
subgroup = dist.new_group(list(range(world)))
tensor = torch.ones(1000)
dist.all_gather([torch.empty(1000) for _ in range(world)], tensor)
dist.all_reduce(tensor, group=subgroup)

reducer_cycle = {"model": nn.parallel.DistributedDataParallel(nn.Linear(4, 4))}  # holds the world group from C++
reducer_cycle["self"] = reducer_cycle  # only gc.collect frees it, as a Trainer's cycles are freed
del reducer_cycle
if rank == world - 1:
    time.sleep(1.0)  # the others reach the exit hook with the all-reduce below still running
dist.all_reduce(torch.ones(1000), async_op=True)  # its work and tensor outlive their Python objects
print(f"rank {rank} leaves", flush=True)
