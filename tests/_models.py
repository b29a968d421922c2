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
