"""Training models of different shapes for the benchmarks that measure a capture's cost (issue 44 item 7): what a
window costs depends on how many events it records (operators, Python calls with with_stack) and on how deep its
stacks are, not on the FLOPs, so one model is not enough.

    linear512   8 x (Linear(512) + ReLU), batch 32: bench_hook's model, the one the README's numbers used before
    linear256   8 x (Linear(256) + ReLU), batch 32: issue 44's (the same layers, a quarter of the arithmetic)
    large       4 x Linear(2048), batch 16: few large operators (a step of mostly GEMM time, few events); its
                gradients are zeroed, not set to None: four 16 MB gradients allocated afresh each step were mmapped
                by glibc (16,000 page faults a step) until the memory a window freed raised glibc's mmap threshold
                above them, after which they were not, so the steps after a window ran 10-20 ms faster, or slower,
                than the idle steps before it, for torch.profiler and for us alike, more than the window cost
    small       100 x (Linear(8) + ReLU), batch 4: many small operators (200 modules a forward; events dominate)
    deep        30 nested modules, each a Linear(64) + ReLU and the next one, batch 16: deep Python stacks
                (about 90 frames at the innermost call; with_stack records every level)

Each builder returns the model and the shape of one batch; train_step is the same for all (forward, sum, backward,
SGD step; on a GPU the loss is read back, so the step ends when its kernels are done).
"""

from __future__ import annotations

from typing import Any, Callable

MODELS: dict[str, str] = {
    "linear512": "8 Linear(512)",
    "linear256": "8 Linear(256)",
    "large": "4 Linear(2048)",
    "small": "100 Linear(8)",
    "deep": "30 nested modules",
}


def _nested(depth: int, width: int) -> Any:
    import torch

    class Nested(torch.nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)
            self.act = torch.nn.ReLU()
            self.inner = Nested(depth - 1) if depth > 1 else None

        def forward(self, x: Any) -> Any:
            x = self.act(self.linear(x))
            return self.inner(x) if self.inner is not None else x

    return Nested(depth)


def make(name: str) -> tuple[Any, tuple[int, ...]]:
    """(model, batch shape) of `name` (MODELS), seeded so every variant trains the same weights."""
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if name == "linear512":
        return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)]), (32, 512)
    if name == "linear256":
        return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)]), (32, 256)
    if name == "large":
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]), (16, 2048)
    if name == "small":
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(100)]), (4, 8)
    if name == "deep":
        return _nested(30, 64), (16, 64)
    raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def model_and_step(name: str, device: str = "cpu") -> tuple[Any, Any, Callable[[Any, Any], None]]:
    """(model, optimizer, train_step(model, opt)) for `name` on `device`."""
    import torch

    model, shape = make(name)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    on_gpu = device != "cpu"
    set_to_none = name != "large"  # (the module docstring: large's gradients are kept)

    def train_step(model: Any, opt: Any) -> None:
        loss = model(torch.randn(*shape, device=device)).sum()
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        if on_gpu:
            loss.item()

    return model, opt, train_step
