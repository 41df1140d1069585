"""A small Llama-shaped causal language model on generated tokens under the Hugging Face ``Trainer``: the script a
``transformers`` user writes (``TrainingArguments``, a collator, ``Trainer.train``), built from a config (nothing
downloaded), tuned through ddp-autotune's Trainer adapter (``hf_trainer_lm_plain.py`` is the script without it;
docs/frameworks.md shows the diff), measured in tokens/s. The search tunes the batch per device, accumulation,
precision, the DataLoader's workers and DDP's buckets: what the script's ``TrainingArguments`` carry.

    torchrun --nproc-per-node 2 examples/hf_trainer_lm.py                 # runs as it always did
    autotune search --script examples/hf_trainer_lm.py:main

The tokens follow a fixed random bigram table (each token has a few likely successors), so the loss falls from
ln(vocab) towards the table's entropy.
"""

import argparse
import math

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from trainer.runtime import transformers as tuned


class BigramTokens(Dataset):
    """``n`` sequences of ``seq_len`` tokens drawn from a fixed random bigram table: made once, in memory."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, 4), generator=g)
        self.tokens = torch.empty(n, seq_len, dtype=torch.long)
        self.tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(seq_len - 1):
            self.tokens[:, t + 1] = successors[self.tokens[:, t], torch.randint(4, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i]}


def collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sequences of one length into a batch; the model shifts its labels itself."""
    input_ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, help="model width (default: 512 on a GPU, 128 on the CPU)")
    p.add_argument("--layers", type=int, help="transformer blocks (default: 8 on a GPU, 2 on the CPU)")
    p.add_argument("--sequences", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", default="hf_trainer_lm", help="the Trainer's output folder")
    return p.parse_args()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    run = tuned.setup(unit="tokens")
    dim, layers = args.dim or (512 if cuda else 128), args.layers or (8 if cuda else 2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=dim, intermediate_size=4 * dim,
                                         num_hidden_layers=layers, num_attention_heads=max(1, dim // 64),
                                         max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0))
    training = run.training_args(TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=32, num_train_epochs=args.epochs, learning_rate=args.lr,
        weight_decay=0.1, bf16=cuda, use_cpu=not cuda, dataloader_num_workers=1, logging_steps=50,
        save_strategy="no", report_to="none"))
    trainer = Trainer(model=model, args=training, data_collator=collate, callbacks=[run.callback()],
                      train_dataset=BigramTokens(args.sequences, args.seq_len, args.vocab))
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"loss {result.training_loss:.3f} (uniform: {math.log(args.vocab):.3f})")


if __name__ == "__main__":
    main()
