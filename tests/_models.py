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


class WideBN(nn.Module):
    """``n`` layers of (per-channel scale, BatchNorm2d(c), tanh) on ``[N, c, 1, 1]`` inputs: BatchNorms over many
    channels and few values each, where per-channel tensors (running statistics and their copies, saved
    statistics) are as large as activations. ``mean_out``: return the per-sample mean instead of the last
    activation."""

    def __init__(self, c=16384, n=6, mean_out=False):
        super().__init__()
        self.scale = nn.ParameterList([nn.Parameter(torch.rand(c, 1, 1) + 0.5) for _ in range(n)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(c) for _ in range(n)])
        self.mean_out = mean_out

    def forward(self, x):
        for s, bn in zip(self.scale, self.bns):
            x = torch.tanh(bn(x * s))
        return x.mean((1, 2, 3)) if self.mean_out else x


class ListOut(nn.Module):
    """Returns three ReLU outputs, which its own convolutions (and ReLUs) save for their backward as well."""

    def __init__(self, c=8):
        super().__init__()
        self.c1 = nn.Conv2d(3, c, 3, padding=1)
        self.c2, self.c3 = nn.Conv2d(c, c, 3, stride=2, padding=1), nn.Conv2d(c, c, 3, stride=2, padding=1)

    def forward(self, x):
        a = F.relu(self.c1(x))
        b = F.relu(self.c2(a))
        return [a, b, F.relu(self.c3(b)).flatten(1)]


class BetweenConvolutions(nn.Module):
    """``body(h, conv) -> (c, extra)`` between two 3x3 convolutions on ``[N, 16, H, W]``: ``h`` is the first's
    output, ``c`` what the head pools (the second convolution's output, usually), ``extra`` a number added to it (a
    view of ``h`` read after the second convolution, where the gradient autograd makes for it is alive through that
    convolution's backward). For in-place patterns of the user's code (tests/test_augmented.py,
    benchmarks/view_update_patterns.py)."""

    def __init__(self, body) -> None:
        super().__init__()
        self.body = body
        self.c1, self.c2, self.fc = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1), nn.Linear(16, 10)

    def forward(self, x):
        c, extra = self.body(self.c1(x), self.c2)
        return self.fc(c.mean((2, 3)) + extra)


def channel_mix_with_relu_mask():
    """Plain PyTorch's figures for one SGD step (momentum 0.9) of :class:`ChannelMix`, then those of a plan
    that keeps everything with every ReLU as ``relu-mask``: ``(base, fig, predicted peak bytes, ReLUs forced)``."""
    import memfit
    from memfit.bench.harness import fresh_copy, measure_training
    from memfit.solve.simulator import simulate
    from memfit.solve.strategies import make_plan

    torch.manual_seed(0)
    model = ChannelMix().train()
    x, y = torch.randn(8, 3, 24, 24), torch.randint(0, 10, (8,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(model)
    _, captured, costs = memfit.plan(m, x, budget="100%", loss_fn=lambda out: F.cross_entropy(out, y))
    plan = make_plan("none", captured.graph, costs)
    forced = {c.name: "relu-mask" for c in costs.nodes if "relu-mask" in c.variants}
    plan.variants.update(forced)
    planned = memfit.optimize(m, x, plan_=plan)
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    momentum = sum(p.numel() * p.element_size() for p in m.parameters())  # measure_training's SGD state
    return base, fig, simulate(captured.graph, costs, plan, costs.fixed_bytes + momentum).peak_bytes, len(forced)


def plain_and_planned(model, x, y, budget, loss=F.cross_entropy, lr=0.01, strategy="memfit", grads_exist=False):
    """Plain PyTorch's figures for one SGD step (momentum 0.9) on a copy of ``model``, then those of a copy planned
    at ``budget`` with ``loss(out, y)`` measured (``lr``: the planning optimizer's): ``(base, planned, fig)``."""
    import memfit
    from memfit.bench.harness import fresh_copy, measure_training

    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1, grads_exist=grads_exist)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget=budget, strategy=strategy, grads_exist=grads_exist,
                              optimizer=torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
                              loss_fn=lambda out: loss(out, y))
    return base, planned, measure_training(planned, planned, (x,), y, loss, steps=1, grads_exist=grads_exist)


# Assignments into part of a tensor between two convolutions (bodies for :class:`BetweenConvolutions`; tests/test_augmented.py,
# benchmarks/view_update_patterns.py)


def into_slice(h, conv):
    h[:, :4] = torch.tanh(h[:, 4:8])
    return conv(h), 0.0


def slice_updated(h, conv):
    h[:, :4] += 1.0  # (Python: read the view, update it in place, assign it back)
    return conv(h), 0.0


def number_into_columns(h, conv):
    h[..., 0] = 0
    return conv(h), 0.0


def by_mask(h, conv):
    h[h < 0] = 0.0
    return conv(h), 0.0


def by_index(h, conv):
    h[:, torch.tensor([1, 3, 5])] = torch.sigmoid(h[:, 8:11])
    return conv(h), 0.0


def traced_bound(h, conv):
    n = h.shape[1] // 2
    h[:, :n] *= 0.5
    return conv(h), 0.0


def view_read_after_assignment(h, conv):
    v = h[:, :8]
    h[:, 8:] = 1.0
    return conv(h), v.mean()


def padded_into_zeros(h, conv):
    # the zeros need no gradient when made, then get one from the assignment: its size was missed (295,936 B
    # over the prediction and the budget)
    out = h.new_zeros(h.shape[0], h.shape[1], h.shape[2] + 2, h.shape[3] + 2)
    out[:, :, 1:-1, 1:-1] = h
    return conv(out)[:, :, 1:-1, 1:-1], 0.0


def zeros_added_into(h, conv):
    g = h.new_zeros(h.shape)
    g.add_(h)  # (the same for a method call: 262,144 B over the prediction and the budget before)
    return conv(g), 0.0


def expanded_copied_into_slice(h, conv):
    # DeepSeek-V3's key assembly: a tensor shared across heads, expanded (stride 0), copied into part of another;
    # planning failed: the profile wrote the expanded operand's stand-in ("more than one element ... refers to a
    # single memory location")
    shared = h[:, :4].amax(1, keepdim=True).expand(-1, 8, -1, -1)
    out = h.new_empty(h.shape)
    out[:, :8].copy_(h[:, 8:])
    out[:, 8:].copy_(shared)
    return conv(out), 0.0


def expanded_assigned_into_slice(h, conv):
    out = h.new_empty(h.shape)
    out[:, :8] = h[:, 8:]
    out[:, 8:] = h[:, :4].amax(1, keepdim=True).expand(-1, 8, -1, -1)
    return conv(out), 0.0


SLICE_ASSIGNMENTS = (into_slice, slice_updated, number_into_columns, by_mask, by_index, traced_bound,
                     view_read_after_assignment, padded_into_zeros, zeros_added_into, expanded_copied_into_slice,
                     expanded_assigned_into_slice)


def trains_as_pytorch_for_its_shapes(model, inputs: tuple, budget="min"):
    """Plan a copy of ``model`` (whose forward reads sizes in Python code: the trace is specialized to ``inputs``'
    shapes, :mod:`memfit.graph.sized`), then run one step of it and of plain PyTorch on another copy, with the sum
    of the outputs' mean squares as the loss: the gradients (to 1e-5) and buffers (BatchNorm statistics) agree.
    Returns ``(planned, plain)``."""
    import memfit
    from memfit.bench.harness import fresh_copy
    from memfit.graph.calls import tensors_in

    def loss(out):
        return sum((t.float() ** 2).mean() for t in tensors_in(out) if t.is_floating_point())

    torch.manual_seed(0)
    plain, m = fresh_copy(model), fresh_copy(model)
    planned = memfit.optimize(m, inputs, budget, loss_fn=loss)
    assert planned.__dict__["_captured"].specialized is not None
    for net in (planned, plain):
        torch.manual_seed(1)
        loss(net(*inputs)).backward()
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    for (name, b), c in zip(m.named_buffers(), plain.buffers()):
        assert torch.equal(b, c), name
    return planned, plain


def draws_as_pytorch(planned, plain, model, x, steps: int):
    """Run ``steps`` steps of ``planned`` (planned from ``model``) and ``plain`` (a copy of it) on ``x``, each from the
    same seed, with the mean square of the output as the loss: the outputs are equal, and the gradients within
    1e-6 (relative), so the planned step draws what PyTorch draws, recomputation included."""
    for step in range(steps):
        outs = []
        for net in (planned, plain):
            torch.manual_seed(step)
            outs.append(net(x))
            outs[-1].pow(2).mean().backward()
        assert torch.equal(*outs)
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)


def trains_as_pytorch_at_min(model, x) -> None:
    """Plan ``model`` at ``min`` (loss: the output's mean square), run one step of it and of plain PyTorch on a deep
    copy made first: every parameter's gradient is equal, bit for bit."""
    import copy

    import memfit

    plain = copy.deepcopy(model)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: out.square().mean())
    for net in (planned, plain):
        net(x).square().mean().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
