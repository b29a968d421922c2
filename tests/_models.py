"""Small models shared by several test files."""

import torch
import torch.nn.functional as F
from torch import nn


class Counter(nn.Module):
    """Updates its own buffers in place in forward (a step counter and an exponential average)."""

    def __init__(self, c=8):
        super().__init__()
        self.c1, self.c2, self.head = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1), nn.Linear(c, 10)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(c))

    def forward(self, x):
        h = F.relu(self.c1(x))
        self.seen.add_(1)
        self.ema.mul_(0.9).add_(h.detach().mean((0, 2, 3)), alpha=0.1)
        h = F.relu(self.c2(h * (1 + self.ema.view(1, -1, 1, 1))))
        return self.head(h.mean((2, 3)))


class TiedLM(nn.Module):
    """Token embedding, one MLP layer and an output layer sharing the embedding's weight (as GPT-2 does)."""

    def __init__(self, vocab=512, width=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(F.gelu(self.mid(self.tok(idx))))


class ChannelMix(nn.Module):
    """A convolution + ReLU module called on channels-last activations (a permuted LayerNorm made them so in a
    fresh-user model) after a chunk/cat mix of channels and before a mean (the ReLU's output gradient is then
    a broadcast)."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.shared = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU())
        self.mix = nn.Conv2d(2 * c, c, 1)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.shared(self.stem(x).contiguous(memory_format=torch.channels_last))
        a, b = torch.chunk(x, 2, dim=1)
        x = self.mix(torch.cat([x, torch.cat([b, a], 1)], 1)) + torch.cat([b, a], 1)
        return self.head(self.shared(x).mean((2, 3)))
