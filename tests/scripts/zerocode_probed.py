"""A training loop with no profiler code whose first imports ask whether torch is there before it is imported:
`python zerocode_probed.py PRELUDE STEPS`, PRELUDE one of find_spec (a bare importlib.util.find_spec("torch")),
transformers, datasets (each probes torch at import, without importing it). Then torch, and STEPS optimizer steps."""

from __future__ import annotations

import sys

prelude, steps = sys.argv[1], int(sys.argv[2])
if prelude == "find_spec":
    import importlib.util

    assert importlib.util.find_spec("torch") is not None
elif prelude == "transformers":
    import transformers  # noqa: F401
elif prelude == "datasets":
    import datasets  # noqa: F401
else:
    raise SystemExit(f"unknown prelude {prelude!r}")
assert "torch" not in sys.modules, f"{prelude} imported torch: the probe this script is about did not happen alone"

import torch  # noqa: E402

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(steps):
    loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
