"""Measured against predicted total peak (bytes), and gradients against plain PyTorch's, for the cases a fresh-user
rounds found on 2026-12-04: a forward returning a dataclass (one whose ``__post_init__`` scales the logits, too),
a model returning its hidden states beside the logits, noise drawn from the model's own ``torch.Generator``, and a
model whose body trains with SGD and whose head trains with Adam. Each case is also a regression test
(``tests/test_inputs.py``, ``tests/test_stateful.py``, ``tests/test_optimizer.py``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fresh_user_outputs_optimizers.py

To see the code before the fixes, run it with ``PYTHONPATH=<a worktree of dcffe1f>/src``: the models come from this
checkout's tests, memfit from that path.
"""

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import memfit
from memfit.profile import MemoryTracker, live_bytes
from test_inputs import _BuildsDataclasses, _DataclassOut, _HiddenStates, _logits_loss
from test_stateful import PrivateNoise


def _state(opts) -> list[torch.Tensor]:
    return [t for o in opts for st in o.state.values() for t in st.values() if torch.is_tensor(t)]


def _step_peak(module, model, opts, x, y, loss) -> int:
    """One warm-up step (it makes the optimizers' state), then the total peak (bytes) of one more, as measured."""
    for o in opts:
        o.zero_grad()
    loss(module(x), y).backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    start = live_bytes(list(model.parameters()) + [x, y] + _state(opts))
    with MemoryTracker() as tracker:
        loss(module(x), y).backward()
        for o in opts:
            o.step()
    return start + tracker.peak_bytes


def _grad_diff(a: nn.Module, b: nn.Module) -> tuple[float, float]:
    """Largest absolute gradient difference, and the largest relative to each gradient's own largest value."""
    pairs = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
    return (max(float((g - h).abs().max()) for g, h in pairs),
            max(float((g - h).abs().max() / h.abs().max()) for g, h in pairs))


def _row(case, measured, planned, diff) -> None:
    p = planned.plan
    print(f"| {case} | {measured:,} | {p.predicted_peak_bytes:,} | {p.budget_bytes:,} | "
          f"{measured / p.budget_bytes:.3f} | {diff} |", flush=True)


def dataclass_output() -> None:
    ids, y = torch.randint(0, 200, (8, 32)), torch.randint(0, 200, (8, 32))
    for budget in ("min", "90%"):
        torch.manual_seed(0)
        model = _DataclassOut().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            planned = memfit.optimize(model, ids, budget, optimizer=opt, loss_fn=lambda out: _logits_loss(out, y),
                                      time_limit=5)
        except memfit.InfeasibleBudgetError as exc:
            print(f"| dataclass output, {budget} | infeasible (smallest feasible {exc.smallest_feasible_bytes:,}) "
                  "| | | | |", flush=True)
            continue
        _row(f"dataclass output, {budget}", _step_peak(planned, model, [opt], ids, y, _logits_loss), planned, "-")


def hidden_states() -> None:
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    for budget in ("100%", "min"):
        torch.manual_seed(0)
        model = _HiddenStates(dataclass_output=False).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def loss(out, target):
            return F.cross_entropy(out[0], target)

        planned = memfit.optimize(model, x, budget, optimizer=opt, loss_fn=lambda out: loss(out, y), time_limit=5)
        _row(f"(logits, 4 hidden states), {budget} ({planned.report['decisions']['recompute']} recomputed)",
             _step_peak(planned, model, [opt], x, y, loss), planned, "-")


def post_init() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = _BuildsDataclasses("scaled").train()
    plain = copy.deepcopy(model)
    case = "dataclass whose __post_init__ scales the logits, strategy none"
    try:
        planned = memfit.optimize(model, x, "100%", strategy="none",
                                  loss_fn=lambda out: F.cross_entropy(out.logits, y), time_limit=5)
    except ValueError as exc:  # (before: its field(init=False) was refused)
        print(f"| {case} | ValueError: {str(exc)[:90]} | | | | |", flush=True)
        return
    ours, theirs = planned(x), plain(x)
    F.cross_entropy(ours.logits, y).backward()
    F.cross_entropy(theirs.logits, y).backward()
    absolute, relative = _grad_diff(model, plain)
    ratio = float((ours.logits / theirs.logits).mean().detach())
    print(f"| {case} | logits {ratio:.2f}x plain PyTorch's | | "
          f"| | {absolute:.2e} ({relative:.2f} relative) |", flush=True)


def private_generator() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(2048, 16), torch.randint(0, 10, (2048,))
    model = PrivateNoise().train()
    plain = copy.deepcopy(model)
    loss = F.cross_entropy
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: loss(out, y), time_limit=5)
    same = torch.equal(model.gen.get_state(), plain.gen.get_state())
    for m in (plain, planned):
        loss(m(x), y).backward()
    absolute, relative = _grad_diff(model, plain)
    print(f"| own torch.Generator, min ({len(planned.plan.regions)} regions) | generator left as it was: {same} | | "
          f"| | {absolute:.2e} ({relative:.2f} relative) |", flush=True)


class _TwoPart(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4000, 256)
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        self.head = nn.Linear(256, 4000)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def two_optimizers() -> None:
    ids, y = torch.randint(0, 4000, (8, 64)), torch.randint(0, 4000, (8, 64))

    def loss(out, target):
        return F.cross_entropy(out.reshape(-1, 4000), target.reshape(-1))

    for budget, given in (("90%", "SGD only"), ("90%", "[SGD, Adam]"), ("min", "[SGD, Adam]")):
        torch.manual_seed(0)
        model = _TwoPart().train()
        opts = [torch.optim.SGD([*model.emb.parameters(), *model.body.parameters()], lr=0.1, momentum=0.9),
                torch.optim.Adam(model.head.parameters(), lr=1e-3)]
        case = f"SGD body + Adam head, {budget}, optimizer={given}"
        try:
            planned = memfit.optimize(model, ids, budget, optimizer=opts[0] if given == "SGD only" else opts,
                                      loss_fn=lambda out: loss(out, y), time_limit=5)
        except (memfit.InfeasibleBudgetError, TypeError) as exc:
            print(f"| {case} | {type(exc).__name__}: {str(exc)[:90]} | | | | |", flush=True)
            continue
        _row(case, _step_peak(planned, model, opts, ids, y, loss), planned, "-")


def main() -> None:
    torch.set_num_threads(1)
    print("| case | measured | predicted | budget | measured / budget | gradients against plain PyTorch |")
    print("|---|---|---|---|---|---|")
    dataclass_output()
    hidden_states()
    post_init()
    private_generator()
    two_optimizers()


if __name__ == "__main__":
    main()
