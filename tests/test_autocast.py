"""Mixed precision (CPU bfloat16 autocast) against plain PyTorch under the same autocast: the predicted peak
covers the measured one, a plan at ``budget="min"`` stays under its budget, and gradients are PyTorch's.

The training step is PyTorch's recipe: forward pass and loss inside ``torch.autocast``, ``loss.backward()``
and ``opt.step()`` outside it (``measure_training(..., autocast=torch.bfloat16)``). What these tests guard:

* autocast's cache keeps the bfloat16 copy of every parameter from its first use until the context exits,
  also when no layer saves it (the first Linear of a block whose input needs no gradient), and a
  recomputation under autocast makes its own copies;
* an addition of a float32 residual and a bfloat16 branch passes its float32 gradient to the residual, and
  autograd casts a bfloat16 copy for the branch (the two coexist in the backward pass);
* each checkpoint region keeps the CPU RNG state (``preserve_rng_state``), also in float32.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.graph import capture
from memfit.profile import profile_graph
from memfit.solve import simulate
from memfit.solve.accounting import Accounting
from memfit.solve.baselines import block_spans
from memfit.solve.ilp import solve_regions
from memfit.solve.plan import Plan

#: bytes the measured peak may exceed the prediction by: the loss's scalars, which the replay leaves out
SLACK = 64


class Block(nn.Module):
    """Self-attention (q, k, v and output Linears, scaled softmax, dropout on the weights) and, optionally, a
    LayerNorm before it and a GELU feed-forward after it, with float32 residual additions."""

    def __init__(self, d: int, full: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(0.0)
        self.full = full
        self.ln = nn.LayerNorm(d) if full else nn.Identity()
        self.ff1, self.ff2 = (nn.Linear(d, 2 * d), nn.Linear(2 * d, d)) if full else (nn.Identity(), nn.Identity())
        self.scale = d ** -0.5

    def forward(self, x):
        h = self.ln(x)
        a = (self.q(h) @ self.k(h).transpose(-2, -1)) * self.scale
        x = x + self.o(self.drop(a.softmax(-1)) @ self.v(h))
        if self.full:
            x = x + self.ff2(F.gelu(self.ff1(x)))
        return x


class Attention(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, full: bool = True):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, full) for _ in range(layers)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


def _case(full: bool, seq: int):
    torch.manual_seed(0)
    model = Attention(full=full).train()
    return model, torch.randn(8, seq, 64), torch.randint(0, 10, (8,))


@pytest.fixture(scope="module")
def full_block():
    """LayerNorm, attention and feed-forward: plain PyTorch's figures under bfloat16 autocast and in float32."""
    model, x, y = _case(True, 64)
    return model, x, y, {dt: measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1,
                                              autocast=dt) for dt in (torch.bfloat16, None)}


def _planned(model, x, y, strategy: str, budget, dtype, loss=F.cross_entropy):
    m = fresh_copy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        plan, captured, _ = memfit.plan(m, x, budget, strategy=strategy, optimizer=opt, time_limit=2.0,
                                        loss_fn=lambda out: loss(out, y))
    planned = memfit.PlannedModule(captured, plan)
    return plan, measure_training(planned, planned, (x,), y, loss, steps=1, autocast=dtype)


@pytest.mark.parametrize(("strategy", "budget", "dtype"), [
    ("none", "100%", torch.bfloat16),
    ("checkpoint-all", "100%", torch.bfloat16),
    ("memfit", "min", torch.bfloat16),
    ("remat-ilp", "min", torch.bfloat16),
    ("checkpoint-all", "100%", None),  # the RNG state of each region, in float32 too
])
def test_prediction_covers_the_measured_peak(full_block, strategy, budget, dtype):
    """Before the casts, the gradient copies and the RNG states were counted, this model measured 1.3% above
    its prediction with strategy none, 3.4% with checkpoint-all, and 5.7% at budget min (20 KB over it)."""
    model, x, y, base = full_block
    plan, fig = _planned(model, x, y, strategy, budget, dtype)
    check = compare(base[dtype], fig)
    assert check["gradients_match"], check
    assert fig.peak_bytes <= plan.predicted_peak_bytes + SLACK, (fig.peak_bytes, plan.predicted_peak_bytes)
    assert plan.predicted_peak_bytes <= 1.01 * fig.peak_bytes, (fig.peak_bytes, plan.predicted_peak_bytes)
    if budget == "min":
        assert plan.regions
        assert fig.peak_bytes <= plan.budget_bytes, (fig.peak_bytes, plan.budget_bytes)


class TwoLinears(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.b(F.gelu(self.a(x))).mean((1, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_two_linears_at_min_budget_peak_as_predicted(dtype):
    """At its floor this model recomputes ``a`` and ``gelu`` in one region. The region keeps the CPU RNG state
    (5056 bytes; before it was counted, the prediction was 5060 bytes under the measured peak, in float32 as
    in bfloat16), and its recomputation stops at GELU's saved input, before GELU computes (counted, the
    prediction would be 5 KB over)."""
    torch.manual_seed(0)
    model, x, y = TwoLinears().train(), torch.randn(8, 64, 64), torch.randn(8)
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.mse_loss, steps=1, autocast=dtype)
    plan, fig = _planned(model, x, y, "remat-ilp", "min", dtype, loss=F.mse_loss)
    assert plan.regions and compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= plan.budget_bytes
    assert abs(fig.peak_bytes - plan.predicted_peak_bytes) <= SLACK, (fig.peak_bytes, plan.predicted_peak_bytes)


def test_weight_casts_nothing_saves_live_to_the_end_of_the_forward_pass():
    """The first block's q, k and v read the model input, which needs no gradient: they save the input's cast
    but not their weights', which autocast's cache still holds until the forward pass ends (the peak of this
    model). Before they were counted, the prediction was 25 KB under the measured peak."""
    model, x, y = _case(False, 128)
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1, autocast=torch.bfloat16)
    plan, fig = _planned(model, x, y, "none", "100%", torch.bfloat16)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= plan.predicted_peak_bytes + SLACK, (fig.peak_bytes, plan.predicted_peak_bytes)
    assert plan.predicted_peak_bytes <= fig.peak_bytes + SLACK

    m = fresh_copy(model)
    captured = capture(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        costs = profile_graph(captured, (x,), loss_fn=lambda out: F.cross_entropy(out, y), with_variants=False)
    by_name = {c.name: c for c in costs.nodes}
    kinds = {s.id: s for s in costs.storages}
    q = by_name["blocks_0_q"]
    casts = [kinds[s] for s in q.casts]
    # the weight's and the bias's bfloat16 copies, made by this node, and not saved by it
    assert sorted(s.nbytes for s in casts) == [64 * 2, 64 * 64 * 2]
    assert all(s.kind == "cast" and s.producer == "blocks_0_q" and s.id not in q.saves for s in casts)
    # the output Linear reads an activation that needs a gradient: it saves its weight's cast
    o = by_name["blocks_0_o"]
    assert any(kinds[s].nbytes == 64 * 64 * 2 and s in o.saves for s in o.casts)


def test_casts_stay_alive_in_the_replay_and_in_the_program():
    """The simulator and the integer program read the same accounting: each counts every cast from its first
    reader to the end of the forward pass, and the program's modelled peak is no lower than the replay's,
    with and without regions (less the RNG states of the regions, which only the replay counts)."""
    model, x, y = _case(True, 64)
    captured = capture(fresh_copy(model))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        costs = profile_graph(captured, (x,), loss_fn=lambda out: F.cross_entropy(out, y), with_variants=False)
    acc = Accounting.build(captured.graph, costs)
    assert acc.casts and all(acc.fwd_last[s] == acc.n for s in acc.casts)
    names = [n.name for n in captured.graph.nodes]
    for spans in ([], block_spans(captured.graph)):
        sim = simulate(captured.graph, costs, Plan.from_spans("test", names, spans), fixed_bytes=0)
        res = solve_regions(acc, 0, minimize_peak=True, fix_spans=spans, time_limit=5)
        low = sim.activation_peak_bytes - 16 - acc.region_bytes * len(spans)
        assert res.objective >= low, (spans, res.objective, sim.activation_peak_bytes)


def _bf16_cnn(bn: bool):
    """Five Conv(-BatchNorm)-ReLU blocks, a pooled linear head, its batch, targets and a float32 loss."""
    torch.manual_seed(0)
    layers = []
    for i in range(5):
        layers += [nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1, bias=False)] + ([nn.BatchNorm2d(16)] if bn else [])
        layers += [nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).train()

    def loss(out, target):
        return F.cross_entropy(out.float(), target)

    return model, torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)), loss


def test_a_bf16_batchnorm_cnn_at_the_floor_stays_under_its_budget():
    """A fresh user's Conv-BN-ReLU CNN under bf16 autocast at budget="min" measured 2,255,264 B against a
    budget of 2,095,647 (prediction 1,997,456) with 1-bit-mask ReLUs at region ends: the replay did not count
    a region's last node's output through that node's workspace (the mask packing's temporaries)."""
    import memfit
    from memfit.bench.harness import compare, fresh_copy, measure_training

    model, x, y, loss = _bf16_cnn(bn=True)
    plain = fresh_copy(model)
    base = measure_training(plain, plain, (x,), y, loss, steps=1, autocast=torch.bfloat16)
    m = fresh_copy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(m, x, budget="min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out: loss(out, y))
    fig = measure_training(planned, planned, (x,), y, loss, steps=1, autocast=torch.bfloat16)
    check = compare(base, fig)
    assert check["gradients_match"] and check["bn_stats_match"], check
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.05 * fig.peak_bytes


@pytest.mark.parametrize("bn", [False, True])
def test_bf16_one_bit_mask_relus_at_region_ends_are_predicted(bn):
    """The plan of that CNN at its floor, with every ReLU a 1-bit-mask ReLU, under bf16 autocast: measured =
    predicted (it was above before the replay held a region's last output through its workspace, and 4608 B
    below per convolution with split backward, whose own bfloat16 copy of the weight was counted beside
    autocast's cached one)."""
    import memfit
    from memfit.bench.harness import compare, fresh_copy, measure_training
    from memfit.solve import simulate

    model, x, y, loss = _bf16_cnn(bn)
    plain = fresh_copy(model)
    base = measure_training(plain, plain, (x,), y, loss, steps=1, autocast=torch.bfloat16)
    m = fresh_copy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan, captured, costs = memfit.plan(m, x, budget="min", optimizer=opt, tiling=False,  # (the CNN's own ReLUs)
                                            loss_fn=lambda out: loss(out, y))
    relus = [c.name for c in costs.nodes if "relu-mask" in c.variants]
    assert len(relus) == 5 and plan.regions
    forced = Plan(**{**plan.to_dict(), "strategy": "test", "variants": {**plan.variants, **dict.fromkeys(relus, "relu-mask")}})
    momentum = sum(p.numel() * p.element_size() for p in m.parameters())
    predicted = simulate(captured.graph, costs, forced, costs.fixed_bytes + momentum).peak_bytes
    planned = memfit.PlannedModule(captured, forced)
    fig = measure_training(planned, planned, (x,), y, loss, steps=1, autocast=torch.bfloat16)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes == predicted, (fig.peak_bytes, predicted)


@pytest.mark.parametrize("head", ["relu", "batchnorm"])
def test_bf16_linear_weights_cast_by_autocast_are_freed_by_their_backward(head):
    """Fresh-user runs: bfloat16 MLPs were predicted up to 8.4 MB over their measured peak (memfit refused a
    budget 4 MiB above plain PyTorch's own peak). A Linear's cached bfloat16 weight is held by its saved tensors
    alone in a real step and is freed before autograd casts its weight gradient back to float32; the isolated
    backward kept it alive through autocast's cache. Still over by up to one activation gradient (the output's
    gradient, released between a node's autograd functions), never under."""
    torch.manual_seed(0)
    if head == "relu":
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).train()
        x = torch.randn(512, 256)
    else:
        model = nn.Sequential(nn.Linear(512, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, 2048),
                              nn.BatchNorm1d(2048), nn.LeakyReLU(0.1), nn.Linear(2048, 10)).train()
        x = torch.randn(4, 512)
    y = torch.randint(0, 10, (x.shape[0],))
    plain = fresh_copy(model)
    base = measure_training(plain, plain, (x,), y, F.cross_entropy, steps=1, autocast=torch.bfloat16)
    for strategy in ("none", "memfit"):
        m = fresh_copy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            planned = memfit.optimize(m, x, budget="min" if strategy == "memfit" else "100%", strategy=strategy,
                                      optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                      loss_fn=lambda out: F.cross_entropy(out, y))
        fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1, autocast=torch.bfloat16)
        assert compare(base, fig)["gradients_match"]
        over = planned.plan.predicted_peak_bytes - fig.peak_bytes
        assert 0 <= over <= x.shape[0] * 1024 * 2 + 65536, (strategy, over)
        assert fig.peak_bytes <= planned.plan.budget_bytes


class _LearnedGrid(nn.Module):
    """A learned affine grid (a spatial transformer) with a tensor constant, which fx keeps as a buffer."""

    def __init__(self):
        super().__init__()
        self.c, self.theta, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 6), nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.c(x))
        th = self.theta(h.mean((2, 3))).view(-1, 2, 3) * 0.1 + torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
        h = F.grid_sample(h, F.affine_grid(th.float(), [x.shape[0], 8, 4, 4], align_corners=False),
                          align_corners=False)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("strategy", ["checkpoint-all", "chen"])
def test_the_first_step_under_autocast_with_regions_is_pytorchs_bit_for_bit(strategy):
    # found by a fresh user: the first training step ran under the dispatch mode that finds the buffers a forward
    # pass writes, which under bfloat16 autocast ran other kernels: gradients 0.0046 off in that step (exact after),
    # though the profile had found that no buffer is written
    torch.manual_seed(0)
    model = _LearnedGrid().train()
    reference = fresh_copy(model)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(model, x, strategy=strategy, loss_fn=lambda o: F.cross_entropy(o.float(), y))
    assert planned.plan.regions and planned.plan.buffer_kinds_known and not planned.plan.buffer_kinds
    for net in (planned, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x).float(), y)
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), (name, (p.grad - q.grad).abs().max())


def test_a_backward_pass_inside_autocast_is_warned_about_and_measured_over_the_prediction():
    """Found by a fresh user: ``loss.backward()`` inside the autocast context went over the budget silently (the
    README says to call it outside). Its operations are autocast too and make bfloat16 copies the plan does not
    count: measured here above the predicted peak. Outside the context the same step warns of nothing."""
    import warnings

    from memfit.profile import MemoryTracker, live_bytes

    model, x, y = _case(True, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(model, x, "min", time_limit=2, loss_fn=lambda out: F.cross_entropy(out, y))
    start = live_bytes(list(model.parameters()) + [x, y])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recipe: forward and loss inside, backward outside
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(planned(x), y)
        loss.backward()
    model.zero_grad()
    inside = r"backward pass through Attention ran inside torch.autocast.*outside"
    with (pytest.warns(UserWarning, match=inside), MemoryTracker() as tracker,
          torch.autocast("cpu", dtype=torch.bfloat16)):
        F.cross_entropy(planned(x), y).backward()
    assert start + tracker.peak_bytes > planned.plan.predicted_peak_bytes + SLACK  # why it is warned about


class _EmbeddingHead(nn.Module):
    """A language model's embedding and output head, with optional blocks and tied weights."""

    def __init__(self, blocks: int = 0, tie: bool = False, vocab: int = 4000, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 128, 0.0, batch_first=True, norm_first=True)
                                     for _ in range(blocks)])
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _token_loss(out, target):
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten())


@pytest.mark.parametrize(("blocks", "tie"), [(0, False), (2, True)])
def test_a_weight_cast_no_kept_node_saves_is_gone_before_the_loss_backward(blocks, tie):
    """A fresh user's bfloat16 language model at ``budget="min"``: the head is recomputed, so nothing kept saves
    its weight's bfloat16 copy, which autocast's cache frees as the context exits, before ``loss.backward()``.
    The replay kept it through the loss's backward pass, the step's peak: predicted 512,000 bytes (the copy;
    644,864 with two tied blocks, 4%) over the measured peak, and an ``85%`` budget the plan met was refused."""
    torch.manual_seed(0)
    model = _EmbeddingHead(blocks, tie).train()
    ids, target = torch.randint(0, 4000, (4, 64)), torch.randint(0, 4000, (4, 64))
    base = measure_training(*[fresh_copy(model)] * 2, (ids,), target, _token_loss, steps=1, autocast=torch.bfloat16)
    plan, fig = _planned(model, ids, target, "memfit", "min", torch.bfloat16, loss=_token_loss)
    assert plan.regions and compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= plan.budget_bytes
    assert abs(fig.peak_bytes - plan.predicted_peak_bytes) <= SLACK, (fig.peak_bytes, plan.predicted_peak_bytes)


class _AutocastInside(nn.Module):
    """A bfloat16 block inside forward, or a float32 head kept out of the caller's autocast."""

    def __init__(self, island: bool):
        super().__init__()
        self.a, self.head, self.island = nn.Linear(32, 32), nn.Linear(32, 4), island

    def forward(self, x):
        if self.island:
            h = F.relu(self.a(x))
            with torch.autocast("cpu", enabled=False):
                return self.head(h.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.relu(self.a(x))
        return self.head(h.float())


@pytest.mark.parametrize("island", [False, True])
def test_autocast_entered_inside_forward_is_refused_naming_the_line(island):
    # fresh user: fx does not record autocast blocks; the traced-output check caught them as "a Python test in
    # forward", naming no line. A float32 island traced outside autocast changes nothing and plans.
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    model = _AutocastInside(island).train()
    ref = fresh_copy(model)
    with (torch.autocast("cpu", dtype=torch.bfloat16, enabled=island),
          pytest.raises(memfit.TraceError, match=r"enters torch.autocast, which torch.fx does not record.*\n  "
                                                 r"failing line: .*test_autocast.py:\d+ in forward: with torch")):
        memfit.optimize(model, x, "min")
    if island:
        planned = memfit.optimize(model, x, "min")
        F.cross_entropy(planned(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name


class _ChecksAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = F.relu(self.a(x))
        if torch.is_autocast_enabled("cpu"):  # (a float32 head under autocast)
            h = h.float() * 0.5
        return self.head(h)


def test_a_forward_testing_the_autocast_state_is_refused_in_another_state():
    # the graph holds the branch the planning state took; trained in another state, it ran the other branch's
    # graph with only a warning about memory figures
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    model = _ChecksAutocast().train()
    ref = fresh_copy(model)
    planned = memfit.optimize(model, x, "min")
    F.cross_entropy(planned(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    with (torch.autocast("cpu", dtype=torch.bfloat16),
          pytest.raises(TypeError, match=r"outside torch.autocast and the planned module is called under "
                                         r"torch.autocast\(torch.bfloat16\), but the forward reads the autocast state "
                                         r"\(.*test_autocast.py:\d+: +if torch.is_autocast_enabled")):
        planned(x)
    plain = memfit.optimize(nn.Sequential(nn.Linear(32, 4)).train(), x, "min")  # (no test: a warning only)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="outside torch.autocast"):
        plain(x)


@pytest.mark.parametrize("variants", [True, "exact"])
def test_an_encoder_applied_to_several_views_under_bf16_trains_as_pytorch(variants):
    """Found by a fresh-user run: an encoder applied to three views under bfloat16 autocast, planned with
    ``variants="exact"``, had gradients 2.2e-3 off plain PyTorch's (0.076 after one SGD step). PyTorch's
    convolutions share autocast's one cached bfloat16 copy of the weight, whose gradient autograd sums in bfloat16;
    ``conv-split-backward`` cast the weight itself at each call, its three contributions summed in float32. A layer
    whose parameters other nodes read keeps PyTorch's implementation under autocast."""
    torch.manual_seed(0)

    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

        def forward(self, x):
            return torch.stack([self.enc(v) for v in x.unbind(0)])

    model, x = Views().train(), torch.randn(3, 8, 3, 32, 32)

    def loss(out, _target=None):
        return (out[0].float() * (out[1] + out[2]).float()).sum()

    base = measure_training(*[fresh_copy(model)] * 2, (x,), None, loss, steps=1, autocast=torch.bfloat16)
    m = fresh_copy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(m, x, budget="80%", variants=variants, loss_fn=loss,
                                  optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    fig = measure_training(planned, planned, (x,), None, loss, steps=1, autocast=torch.bfloat16)
    for name, g in base.grads.items():
        assert torch.equal(g, fig.grads[name]), (name, (g - fig.grads[name]).abs().max())
    assert compare(base, fig)["bn_stats_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes


class _Applied(nn.Module):
    """One layer applied at each step under autocast: a ``Linear`` with ``tanh`` (a block applied ``k`` times; with
    ``explicit``, its weights converted by the forward's own ``.to(torch.bfloat16)`` at each call; with ``both``,
    the module and a converted weight in turn) or an
    ``nn.GRUCell`` over the steps of a sequence ``[steps, batch, 32]``."""

    def __init__(self, kind: str, k: int = 3):
        super().__init__()
        self.kind, self.k = kind, k
        self.inp = nn.Linear(32, 512) if kind != "gru" else None
        self.layer = nn.Linear(512, 512) if kind != "gru" else nn.GRUCell(32, 512)
        self.head = nn.Linear(512, 10)

    def forward(self, xs):
        if self.kind == "explicit":  # (a copy per call, each with a backward of its own: summed in float32)
            h = self.inp(xs.mean(0))
            for _ in range(self.k):
                h = torch.tanh(F.linear(h, self.layer.weight.to(torch.bfloat16), self.layer.bias.to(torch.bfloat16)))
        elif self.kind == "linear":
            h = self.inp(xs.mean(0))
            for _ in range(self.k):
                h = torch.tanh(self.layer(h))
        elif self.kind == "both":  # (the layer as a module, through autocast's copy, and converted by the forward)
            h = self.inp(xs.mean(0))
            for _ in range(self.k):
                h = torch.tanh(self.layer(h))
                h = torch.tanh(F.linear(h, self.layer.weight.to(torch.bfloat16)))
        else:
            h = xs.new_zeros(xs.shape[1], 512)
            for t in range(xs.shape[0]):
                h = self.layer(xs[t], h)
        return self.head(h)


@pytest.mark.parametrize("kind,batch,grads_exist,budget", [
    ("linear", 64, False, "100%"), ("linear", 64, True, "100%"), ("gru", 16, False, "100%"),
    ("gru", 16, True, "100%"), ("gru", 16, False, "min"), ("explicit", 64, False, "100%"), ("both", 64, False, "100%"),
    ("both", 256, False, "min")])
def test_a_layer_applied_at_each_step_under_bf16_is_predicted_as_measured(kind, batch, grads_exist, budget):
    """Found by fresh-user runs: a layer called several times under bfloat16 autocast (a block applied three times,
    a ``GRUCell`` per time step) was predicted one bfloat16 copy of its weights over its measured peak (8-11%), so
    ``budget="min"`` named a floor above plain PyTorch's peak (1.051x) and byte budgets plain PyTorch meets were
    refused. The calls share autocast's cached copy of each weight: autograd sums their contributions in bfloat16,
    in the buffer of the copy's backward, and makes the float32 gradient once, after the first call's backward.
    The replay had a float32 gradient from the last call's backward on. A weight the forward converts itself at each
    call (``explicit``) has a copy per call, each with a backward of its own, so its contributions are summed in
    float32: counted as before (counted as the others, that step went 8.5% over its budget). A weight read both ways
    (``both``, found by a fresh user) has the cached copy's readers' contributions summed in bfloat16 beside the
    float32 ones: counted as float32 contributions, the step went one bfloat16 weight over its ``min`` budget."""
    torch.manual_seed(0)
    model = _Applied(kind).train()
    xs, y = torch.randn(8, batch, 32), torch.randint(0, 10, (batch,))
    base = measure_training(*[fresh_copy(model)] * 2, (xs,), y, F.cross_entropy, steps=1, autocast=torch.bfloat16,
                            grads_exist=grads_exist)
    m = fresh_copy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(m, xs, budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out: F.cross_entropy(out, y), grads_exist=grads_exist)
    fig = measure_training(planned, planned, (xs,), y, F.cross_entropy, steps=1, autocast=torch.bfloat16,
                           grads_exist=grads_exist)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)
    if budget == "min":
        assert planned.plan.budget_bytes < base.peak_bytes


@contextlib.contextmanager
def _autocast_cache(on: bool):
    """Autocast's cache setting for the ``torch.autocast`` contexts opened inside (they inherit it)."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(on)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def test_a_plan_made_with_another_autocast_cache_setting_is_warned_about():
    """Found by a fresh user: a ``GRUCell`` loop planned under bf16 autocast with its cache on and trained with
    ``cache_enabled=False`` measured 1.05-1.51x its budget, unwarned (each reader then makes its own copy of the
    weights). Called so, the planned module warns; a saved plan applied so is refused; a plan made with the cache
    off trains within its budget and gradients as plain PyTorch's with the cache off."""
    torch.manual_seed(0)
    model = _Applied("gru").train()
    xs, y = torch.randn(8, 16, 32), torch.randint(0, 10, (16,))
    m = fresh_copy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(m, xs, "100%", loss_fn=lambda out: F.cross_entropy(out, y))
    assert planned.plan.autocast_cache is True
    with (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
          pytest.warns(UserWarning, match=r"cache_enabled=True\) and is called under cache_enabled=False")):
        planned(xs)
    with (_autocast_cache(False), torch.autocast("cpu", dtype=torch.bfloat16),
          pytest.raises(ValueError, match=r"cache_enabled=True\), and this call is under cache_enabled=False")):
        memfit.optimize(fresh_copy(model), xs, plan_=planned.plan)
    with _autocast_cache(False):
        base = measure_training(*[fresh_copy(model)] * 2, (xs,), y, F.cross_entropy, steps=1,
                                autocast=torch.bfloat16)
        m = fresh_copy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            planned = memfit.optimize(m, xs, "100%", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                      loss_fn=lambda out: F.cross_entropy(out, y))
        assert planned.plan.autocast_cache is False
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="memfit: the plan was made")
            fig = measure_training(planned, planned, (xs,), y, F.cross_entropy, steps=1, autocast=torch.bfloat16)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
