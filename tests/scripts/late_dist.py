"""A rank whose profiler exists before its process group, as in a Lightning callback's __init__ or an mp.spawn
script: at construction there is no RANK, WORLD_SIZE or MASTER_PORT in the environment; the group is joined
later through a tcp:// init method (so the launcher's environment never names the job, and the ranks must agree
on one through the store).

    python late_dist.py RANK WORLD PORT STOP_FILE [--profile flags...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from ondemand_prof import OnDemandProfiler, add_profile_args

for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
    os.environ.pop(var, None)
parser = argparse.ArgumentParser()
parser.add_argument("rank", type=int)
parser.add_argument("world", type=int)
parser.add_argument("port", type=int)
parser.add_argument("stop_file")
parser.add_argument("--delay", type=float, default=1.5, help="seconds between the profiler and the group")
add_profile_args(parser)
args = parser.parse_args()
prof = OnDemandProfiler.from_args(args, parser)
time.sleep(args.delay)  # the profiler registers (as rank 0 of 1, job pid...) before the group exists
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
model = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop = torch.zeros(1)
while True:
    loss = model(torch.randn(8, 32)).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    time.sleep(0.02)
    prof.step()
    stop.fill_(1.0 if os.path.exists(args.stop_file) else 0.0)
    dist.all_reduce(stop)  # every rank stops at the same step
    if stop.item():
        break
prof.close()
dist.destroy_process_group()
sys.exit(0)
