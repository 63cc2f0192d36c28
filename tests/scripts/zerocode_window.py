"""enable() with a static window over steps 1-2 of a 5-step loop. python zerocode_window.py SAVE_PATH"""

from __future__ import annotations

import sys

import torch

import ondemand_prof

ondemand_prof.enable(enabled=True, step_start=1, step_end=3, ondemand=False, save_path=sys.argv[1], min_free_mb=0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
