"""A Hugging Face causal-LM training script shaped like transformers' examples/pytorch/language-modeling/run_clm.py,
with no profiler code: datasets and evaluate are imported before torch (they ask importlib.util.find_spec("torch")
at import, without importing it), then torch and transformers; a tiny GPT-2 from a config (nothing downloaded)
trains on a datasets.Dataset with the Trainer.

    ONDEMAND_PROF_AUTO=1 torchrun --nproc-per-node 2 zerocode_hf_clm.py --steps 200
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import evaluate  # noqa: F401 - run_clm imports it here, for its accuracy metric
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments, default_data_collator

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

tokens = torch.randint(0, 128, (4096, 32), generator=torch.Generator().manual_seed(0)).tolist()
train = datasets.Dataset.from_dict({"input_ids": tokens, "labels": tokens})
model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
targs = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf-clm-"), max_steps=args.steps,
                          per_device_train_batch_size=4, gradient_accumulation_steps=2, logging_steps=50,
                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                          dataloader_num_workers=0)
transformers.logging.set_verbosity_warning()
trainer = Trainer(model=model, args=targs, train_dataset=train, data_collator=default_data_collator)
trainer.train()
