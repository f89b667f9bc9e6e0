"""A Hugging Face ``transformers`` Trainer job as its users write one, on CPU and gloo.

It never imports rankwatch.  A tiny GPT-2 built from a config (no download), a synthetic
token dataset, ``TrainingArguments`` with their defaults but for what a CPU job and a short
test need.  The defaults matter: with ``average_tokens_across_devices`` (on by default) the
Trainer all-gathers each batch's token count after fetching the batch and before the forward,
so a rank with a slow loader makes the others wait in that all-gather.  The test's knobs are
arguments, as a user's script has them:

* ``--slow-loader RANK:SECONDS:FROM``: from optimizer step FROM on, each batch of that rank's
  loader takes SECONDS longer;
* ``--count-out PATH``: the Trainer's own count of optimizer steps (``global_step``) is written
  there at the end, one file per rank (``PATH.<rank>``).
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int, delay: float, from_sample: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.delay, self.from_sample = delay, from_sample
        self.served = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        self.served += 1
        if self.delay and self.served > self.from_sample:
            time.sleep(self.delay)
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--slow-loader", default=None)
    p.add_argument("--count-out", default=None)
    p.add_argument("--output-dir", default="hf-out")
    args = p.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    delay, from_sample = 0.0, 0
    if args.slow_loader:
        who, seconds, start = args.slow_loader.split(":")
        if int(who) == rank:
            delay, from_sample = float(seconds) / args.batch_size, int(start) * args.batch_size
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Tokens(args.steps * args.batch_size * world, args.seq, config.vocab_size, delay, from_sample)
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps,
                                 per_device_train_batch_size=args.batch_size, use_cpu=True,
                                 ddp_backend="gloo", save_strategy="no", report_to=[],
                                 logging_strategy="no", disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.train()
    if args.count_out:
        with open(f"{args.count_out}.{rank}", "w") as f:
            f.write(str(trainer.state.global_step))
    # What a careful user does: free DDP before the process group, and the group before exit.
    # (Left to the interpreter's final collection, gloo's threads abort the process now and
    # then, "terminate called without an active exception", with or without rankwatch.)
    del trainer, model
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
