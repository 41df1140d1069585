"""A small decoder-only transformer language model on generated tokens under Hugging Face Accelerate: the loop an
Accelerate user writes (``prepare``, ``accumulate``, ``backward``), not image classification, tuned through
ddp-autotune's Accelerate adapter (``accelerate_lm_plain.py`` is the script without it; the README shows the diff),
measured in tokens/s. The search tunes the Accelerator's mixed precision, accumulation and DDP buckets, and the
loader's batch and workers.

    torchrun --nproc-per-node 2 examples/accelerate_lm.py                 # runs as it always did
    autotune search --script examples/accelerate_lm.py

The tokens follow a fixed random bigram table (each token has a few likely successors), so the loss falls from
ln(vocab) towards the table's entropy.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer.runtime import accelerate as tuned


class BigramTokens(Dataset):
    """``n`` sequences of ``seq_len + 1`` tokens drawn from a fixed random bigram table: made once, in memory."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, 4), generator=g)
        self.tokens = torch.empty(n, seq_len + 1, dtype=torch.long)
        self.tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(seq_len):
            self.tokens[:, t + 1] = successors[self.tokens[:, t], torch.randint(4, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(1, seq_len, dim))
        block = nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        return self.head(self.blocks(self.embed(tokens) + self.pos[:, :n], mask=self.mask[:n, :n], is_causal=True))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, help="model width (default: 512 on a GPU, 128 on the CPU)")
    p.add_argument("--layers", type=int, help="transformer blocks (default: 8 on a GPU, 2 on the CPU)")
    p.add_argument("--sequences", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    run = tuned.setup(unit="tokens")
    accelerator = run.accelerator(mixed_precision="bf16" if cuda else "no", samples=lambda t: t[:, 1:].numel())
    loader = DataLoader(BigramTokens(args.sequences, args.seq_len, args.vocab), batch_size=32, shuffle=True,
                        num_workers=1, persistent_workers=True, drop_last=True)
    model = TinyLM(args.vocab, args.seq_len, args.dim or (512 if cuda else 128), args.layers or (8 if cuda else 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    criterion = nn.CrossEntropyLoss()
    for epoch in run.epochs(args.epochs):
        for tokens in loader:
            with accelerator.accumulate(model):
                loss = criterion(model(tokens[:, :-1]).reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if run.report(tokens[:, 1:].numel(), loss):
                break
        accelerator.print(f"epoch {epoch}: loss {loss.item():.3f} (uniform: {math.log(args.vocab):.3f})")


if __name__ == "__main__":
    main()
