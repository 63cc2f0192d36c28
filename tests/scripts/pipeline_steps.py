"""A small pipeline-parallel training run (torch.distributed.pipelining) with the hook in it: an MLP of 2 layers a
rank, gloo on CPU, 4 microbatches a step: ScheduleGPipe or Schedule1F1B (one stage of 2 layers a rank), or
ScheduleInterleaved1F1B (2 stages of one layer a rank: rank r holds stages r and r + world size); `prof.step()` each
step, so ondemand_prof's flags (a static window: --profile --profile-step-start S --profile-step-end E) record steps.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/scripts/pipeline_steps.py --steps 6 \\
        --schedule gpipe --profile --profile-step-start 3 --profile-step-end 5 --profile-ranks -1
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ondemand_prof import OnDemandProfiler, add_profile_args

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=6, help="training steps")
parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="gpipe")
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--batch", type=int, default=32)
add_profile_args(parser)
args = parser.parse_args()

prof = OnDemandProfiler.from_args(args, parser)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
h = args.hidden
# each rank builds the whole model from one seed and keeps its part
layers = [torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU()) for _ in range(2 * world)]
loss_fn = torch.nn.MSELoss()
if args.schedule == "interleaved":
    parts = [layers[rank], layers[rank + world]]
    stages = [PipelineStage(parts[k], rank + k * world, 2 * world, torch.device("cpu")) for k in range(2)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
else:
    parts = [torch.nn.Sequential(*layers[2 * rank:2 * rank + 2])]  # stage r: layers 2r and 2r + 1
    stage = PipelineStage(parts[0], rank, world, torch.device("cpu"))
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
first, last = rank == 0, rank == world - 1  # the first stage is rank 0's, the last the last rank's (both schedules)
opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.01)
for step in range(args.steps):
    x, y = torch.randn(args.batch, h), torch.randn(args.batch, h)
    opt.zero_grad()
    if first and last:  # (one rank: the first stage and the last)
        schedule.step(x, target=y, losses=[])
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()
    opt.step()
    prof.step()
prof.close()
dist.barrier()
dist.destroy_process_group()
