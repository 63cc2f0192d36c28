"""A plain training loop with the hook: two lines added (marked "ondemand_prof").

    python examples/plain_loop.py &          # trains for 5 minutes (--minutes M, or --steps N)
    # the start-up line on stderr says how to capture it, e.g.
    ondemandctl capture --steps 3 --wait     # with ondemand-profd running
    ondemandctl trigger --steps 3 --wait     # no daemon: the trigger file (the start-up line's touch)

A static window, as with Megatron's flags: --profile --profile-step-start 5 --profile-step-end 8.
"""

from __future__ import annotations

import argparse
import time

import torch

from ondemand_prof import OnDemandProfiler, add_profile_args

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--minutes", type=float, default=5.0, help="train this long (default 5: time to capture it)")
parser.add_argument("--steps", type=int, default=0, help="or stop after this many steps (0: no limit)")
add_profile_args(parser)
args = parser.parse_args()
deadline = time.monotonic() + args.minutes * 60

prof = OnDemandProfiler.from_args(args, parser)  # ondemand_prof
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while time.monotonic() < deadline and (not args.steps or step < args.steps):
    step += 1
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    prof.step()  # ondemand_prof: one call at the end of every step
prof.close()
