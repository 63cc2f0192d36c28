"""DistributedDataParallel under torchrun (gloo on CPU, NCCL on GPUs): the same two lines as a plain loop.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py &     # trains for 5 minutes (--minutes M, or --steps N)
    ondemandctl capture --ranks 1 --steps 3 --wait              # one job (torchrun's run id), ranks 0 and 1

The profiler may be made before or after init_process_group: its rank and job settle when the group exists.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ondemand_prof import OnDemandProfiler, add_profile_args

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--minutes", type=float, default=5.0, help="train this long (default 5: time to capture it)")
parser.add_argument("--steps", type=int, default=0, help="or stop after this many steps (0: no limit)")
add_profile_args(parser)
args = parser.parse_args()
deadline = time.monotonic() + args.minutes * 60

prof = OnDemandProfiler.from_args(args, parser)  # ondemand_prof
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                                    torch.nn.Linear(128, 10)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop = torch.zeros(1, device=device)
step = 0
while not args.steps or step < args.steps:
    if step % 50 == 0:  # every 50 steps the ranks agree whether --minutes are up (all stop at the same step)
        stop.fill_(float(time.monotonic() >= deadline))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
    step += 1
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    prof.step()  # ondemand_prof
prof.close()
dist.destroy_process_group()
