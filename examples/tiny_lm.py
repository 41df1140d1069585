"""A small decoder-only transformer language model on generated tokens, measured in tokens/s: a job that is not
image classification, tuned through the ddp-autotune runtime.

    torchrun --nproc-per-node 2 examples/tiny_lm.py                       # runs as it always did
    autotune search --script examples/tiny_lm.py                          # a fresh process per trial
    autotune search --script examples/tiny_lm.py:main                     # one live worker

The tokens follow a fixed random bigram table (each token has a few likely successors), so there is something to
learn: the loss falls from ln(vocab) towards the table's entropy.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from trainer import runtime


class BigramTokens(Dataset):
    """``n`` sequences of ``seq_len + 1`` tokens drawn from a fixed random bigram table: made once, in memory."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, 4), generator=g)  # four likely next tokens per token
        tokens = torch.empty(n, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(seq_len):
            pick = torch.randint(4, (n,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


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
    run = runtime.setup(unit="tokens", precision="bf16" if cuda else "fp32")
    dataset = BigramTokens(args.sequences, args.seq_len, args.vocab)
    sampler = DistributedSampler(dataset)
    loader = run.loader(dataset, batch_size=32, sampler=sampler, num_workers=1, drop_last=True,
                        samples=lambda batch: batch[:, 1:].numel())
    dim, layers = args.dim or (512 if cuda else 128), args.layers or (8 if cuda else 2)
    model = run.model(TinyGPT(args.vocab, args.seq_len, dim, layers, heads=max(1, dim // 64)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    criterion = nn.CrossEntropyLoss()
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for tokens in loader:
            with run.step(optimizer):
                logits = model(tokens[:, :-1])
                loss = criterion(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
                run.backward(loss)
            if run.report(tokens[:, 1:].numel(), loss):
                break
        if run.rank == 0 and not run.in_search:
            print(f"epoch {epoch}: loss {loss.item():.3f} (uniform: {math.log(args.vocab):.3f})", flush=True)
    run.close()


if __name__ == "__main__":
    main()
