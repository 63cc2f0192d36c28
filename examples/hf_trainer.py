"""Hugging Face Trainer on a tiny GPT-2 built from a config (nothing downloaded): one callback.

    python examples/hf_trainer.py --steps 200
    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 200
    ondemandctl capture --steps 3

Step N is the step the Trainer logs as global_step N (the first is 1); gradient accumulation is honoured.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ondemand_prof.integrations.transformers import OnDemandCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args()

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf-example-"), max_steps=args.steps,
                              per_device_train_batch_size=4, gradient_accumulation_steps=args.accumulate,
                              logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                              disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(100000, 32, config.vocab_size),
                      callbacks=[OnDemandCallback(save_path="./profile")])  # ondemand_prof
    trainer.train()


if __name__ == "__main__":
    main()
