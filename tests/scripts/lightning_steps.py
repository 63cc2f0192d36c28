"""A 4-step Lightning run (gradient accumulation 2) recording every step from the first: prints
trainer.global_step as each training_step saw it. python lightning_steps.py SAVE_PATH"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ondemand_prof.integrations.lightning import OnDemandCallback

seen: list[int] = []


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        seen.append(self.trainer.global_step)
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


callback = OnDemandCallback(enabled=True, step_start=0, step_end=-1, ondemand=False, save_path=sys.argv[1],
                            min_free_mb=0)
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, callbacks=[callback],
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))
print(json.dumps({"seen": seen}))
