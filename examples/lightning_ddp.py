"""Lightning with strategy="ddp" on CPU processes: one callback, built before the Trainer.

    python examples/lightning_ddp.py --steps 200
    ondemandctl capture --ranks 1 --steps 3

Step N is the step run while trainer.global_step == N; with --accumulate 2 a step spans two micro-batches.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ondemand_prof.integrations.lightning import OnDemandCallback


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    callback = OnDemandCallback(save_path="./profile")  # ondemand_prof (ONDEMAND_PROF_* variables override)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=32))


if __name__ == "__main__":
    main()
