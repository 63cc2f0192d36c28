"""A loop that updates weights by hand (no optimizer, no process group), run with ONDEMAND_PROF_AUTO=1: the
profiler must still show itself (start-up line, daemon registration) and say that it counts optimizer steps.
Trains until argv[1] exists."""

from __future__ import annotations

import os
import sys
import time

import torch

stop = sys.argv[1]
model = torch.nn.Linear(32, 32)
deadline = time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    loss = model(torch.randn(8, 32)).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    time.sleep(0.01)
