"""A Megatron-style loop: the parser already has Megatron's own --profile flags; add_profile_args adds only
the rest, and the iteration counter is passed so a resumed run numbers its steps as Megatron does.

    python examples/megatron_style.py --train-iters 200 --profile --profile-step-start 10 --profile-step-end 12
    python examples/megatron_style.py --train-iters 200 --resume-iteration 100 --profile \\
        --profile-step-start 150 --profile-step-end 152     # records iterations 150 and 151

Step N is the iteration Megatron numbers N (the value of `iteration` when the step begins), as its own
torch profiler does with --profile-step-start/--profile-step-end.
"""

from __future__ import annotations

import argparse

import torch

from ondemand_prof import OnDemandProfiler, add_profile_args


def megatron_args(parser: argparse.ArgumentParser) -> None:
    """The profiling flags Megatron-LM defines itself (megatron/training/arguments.py), with its defaults."""
    group = parser.add_argument_group("Megatron's own")
    group.add_argument("--profile", action="store_true")
    group.add_argument("--profile-step-start", type=int, default=10)
    group.add_argument("--profile-step-end", type=int, default=12)
    group.add_argument("--profile-ranks", nargs="+", type=int, default=[0])
    group.add_argument("--use-pytorch-profiler", action="store_true")
    group.add_argument("--train-iters", type=int, default=50)
    group.add_argument("--resume-iteration", type=int, default=0, help="stands in for --load: the iteration "
                       "the checkpoint was saved at")


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
megatron_args(parser)
add_profile_args(parser)  # ondemand_prof: Megatron's flags above are left alone, ours are added
args = parser.parse_args()

iteration = args.resume_iteration
prof = OnDemandProfiler.from_args(args, parser, first_step=iteration)  # ondemand_prof
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step() -> float:
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


while iteration < args.train_iters:
    train_step()
    prof.step(iteration)  # ondemand_prof: the iteration that just ended
    iteration += 1
prof.close()
