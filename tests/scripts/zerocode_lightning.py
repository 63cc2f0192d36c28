"""Lightning with strategy="ddp" on 2 CPU processes and no profiler code (examples/lightning_ddp.py without its
callback): Lightning starts rank 1 itself, with no RANK in its environment, and passes the rank to
init_process_group. `ONDEMAND_PROF_AUTO=1 python zerocode_lightning.py --steps 200`"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()
torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(data, batch_size=32))
