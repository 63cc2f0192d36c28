"""A training script with no profiler code at all, profiled on demand by the zero-code start-up hook.

    ONDEMAND_PROF_AUTO=1 python examples/zero_code.py --steps 200
    ONDEMAND_PROF_AUTO=1 torchrun --nproc-per-node 2 examples/zero_code.py --steps 200
    ondemandctl capture --steps 3

A step is counted at each optimizer step (README "Zero-code"); options come from ONDEMAND_PROF_* variables
(ONDEMAND_PROF_SAVE_PATH, ONDEMAND_PROF_ENABLE with ONDEMAND_PROF_STEP_START/END, ...). torchrun's agent
imports torch too but never steps an optimizer, so it neither counts nor registers. Without the installed
start-up hook, one line does the same: `import ondemand_prof; ondemand_prof.enable()`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
if world > 1:
    model = DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.steps):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
if world > 1:
    dist.destroy_process_group()
