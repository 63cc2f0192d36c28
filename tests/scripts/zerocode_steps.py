"""What ondemand_prof.enable() counts as a step: prints one JSON line of current_step after each pattern."""

from __future__ import annotations

import gc
import json

import torch

import ondemand_prof

prof = ondemand_prof.enable(ondemand=False)
again = ondemand_prof.enable()
model = torch.nn.Linear(4, 4)
gen = torch.optim.SGD(model.parameters(), lr=0.1)
disc = torch.optim.Adam(model.parameters())
seen = {"same_profiler": again is prof}


def backward() -> None:
    model(torch.randn(2, 4)).sum().backward()


for _ in range(5):  # two optimizers per iteration (a GAN): one step per iteration, at the first to step
    backward()
    gen.step()
    disc.step()
seen["two_optimizers_5_iterations"] = prof.current_step
for _ in range(3):  # gradient accumulation: 4 micro-batches per optimizer step
    for _ in range(4):
        backward()
    gen.step()
seen["accumulate_4_for_3_updates"] = prof.current_step
gen.step()
gen.step()  # the lead stepped twice in one iteration: two steps
seen["stepped_twice"] = prof.current_step
del gen
gc.collect()
disc.step()  # the lead is gone: the next optimizer to step leads
seen["new_lead"] = prof.current_step
ondemand_prof.integrations.zerocode.disable()
disc.step()
seen["after_disable"] = prof.current_step
print(json.dumps(seen))
