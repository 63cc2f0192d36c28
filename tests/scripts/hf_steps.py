"""A 4-step Hugging Face Trainer run (gradient accumulation 2) recording every step from the first: prints the
steps the Trainer logged. python hf_steps.py SAVE_PATH"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ondemand_prof.integrations.transformers import OnDemandCallback

data = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
dataset = [{"input_ids": row, "labels": row} for row in data]
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, logging_steps=1, save_strategy="no", report_to=[],
                         use_cpu=True, disable_tqdm=True)
callback = OnDemandCallback(enabled=True, step_start=1, step_end=-1, ondemand=False, save_path=sys.argv[1],
                            min_free_mb=0)
trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
trainer.train()
print(json.dumps({"logged": [h["step"] for h in trainer.state.log_history if "loss" in h]}))
