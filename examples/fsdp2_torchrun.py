"""FSDP2 (torch.distributed.fsdp.fully_shard) with activation checkpointing under torchrun: gloo on CPU, NCCL on
GPUs; the hook is the same two lines as a plain loop.

    torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py --steps 200
    ondemandctl capture --steps 3 --report     # all_gather and reduce_scatter per step, by collective

FSDP2's reduce_scatter runs on gloo as an all_reduce; the report names it by the collective FSDP issued.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from ondemand_prof import OnDemandProfiler, add_profile_args

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--hidden", type=int, default=256)
add_profile_args(parser)
args = parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(lambda t: self.fc2(torch.relu(self.fc1(t))), x, use_reentrant=False)


prof = OnDemandProfiler.from_args(args, parser)  # ondemand_prof
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(*[Block(args.hidden) for _ in range(3)]).to(device)
for block in model:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.steps):
    x = torch.randn(32, args.hidden, device=device)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    prof.step()  # ondemand_prof
prof.close()
dist.destroy_process_group()
