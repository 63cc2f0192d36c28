"""A plain training loop with the hook: two lines added (marked "ondemand_prof").

    python examples/plain_loop.py --steps 200
    # the start-up line on stderr says how to trigger a capture, e.g.
    ondemandctl capture --steps 3        # with ondemand-profd running
    touch /tmp/ondemand_prof-$UID/<job>/capture

A static window, as with Megatron's flags: --profile --profile-step-start 5 --profile-step-end 8.
"""

from __future__ import annotations

import argparse

import torch

from ondemand_prof import OnDemandProfiler, add_profile_args

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=50)
add_profile_args(parser)
args = parser.parse_args()

prof = OnDemandProfiler.from_args(args, parser)  # ondemand_prof
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.steps):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    prof.step()  # ondemand_prof: one call at the end of every step
prof.close()
