"""Hugging Face transformers models planned with nothing to do (`100%`, `--strategy none`) against eager PyTorch: the
traced step's peak, gradients and step time, for the ways a training loop calls a causal LM.

A planned step at `100%` with `strategy="none"` keeps every activation, so it should be eager PyTorch's step: where
it is not, the traced graph is another computation (transformers took another branch while traced), and every
budget percentage is of that step. The calls:

* ``plain``: ``model(input_ids=ids, labels=ids)``, no ``attention_mask``: eager PyTorch skips the causal mask
  (SDPA ``is_causal=True``);
* ``ones-mask``: an ``attention_mask`` of all ones, a traced input transformers cannot test for padding;
* ``padded``: an ``attention_mask`` with padding (eager PyTorch builds the mask too);
* ``position-ids``: explicit ``position_ids`` (``arange``), a traced input transformers cannot test for packing;
* ``router-logits``: ``output_router_logits=True`` (mixture-of-experts models' load-balancing loss);
* ``hidden-states``: ``output_hidden_states=True``, the loss plus 0.1 x the mean square of every hidden state.

Then the same model planned at ``50%`` is called with a batch of 1 (transformers' batch check takes another branch
for it): its peak against the budget, and whether it ran unplanned (warned). Models from
``transformers_models.build`` (vocabulary 2000, hidden size 128, 4 layers), batch 8 x 128 tokens, SGD with momentum,
one thread; the step time is the ratio of medians of 7 interleaved steps. Needs ``pip install transformers``.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/transformers_eager_match.py [--models llama,mixtral]
        [--calls plain,ones-mask] [--batch-of-one]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from transformers_models import MODELS, build

import memfit
from memfit.bench.harness import compare, fresh_copy, measure_training

CALLS = "plain,ones-mask,padded,position-ids,router-logits,hidden-states"


class Call(torch.nn.Module):
    """The wrapped model of :func:`transformers_models.build`, called as ``call`` says; returns the loss."""

    def __init__(self, wrapped: torch.nn.Module, call: str):
        super().__init__()
        self.model, self.call = wrapped.model, call

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None):
        extra = {"use_cache": False} if "ForMaskedLM" not in type(self.model).__name__ else {}
        if self.call == "router-logits":
            extra["output_router_logits"] = True
        if self.call == "hidden-states":
            extra["output_hidden_states"] = True
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        if position_ids is not None:
            extra["position_ids"] = position_ids
        out = self.model(input_ids=input_ids, labels=labels, **extra)
        if self.call == "hidden-states":
            return out.loss + 0.1 * sum(h.pow(2).mean() for h in out.hidden_states)
        return out.loss


def inputs_for(call: str, batch: int, tokens: int) -> tuple:
    torch.manual_seed(1)
    ids = torch.randint(0, 2000, (batch, tokens))
    mask = positions = None
    if call == "ones-mask":
        mask = torch.ones_like(ids)
    if call == "padded":
        mask = torch.ones_like(ids)
        mask[1:, tokens * 3 // 4:] = 0
    if call == "position-ids":
        positions = torch.arange(tokens).expand(batch, -1).contiguous()
    return ids, ids.clone(), mask, positions


def interleaved(nets: dict, inputs: tuple, steps: int = 7) -> dict:
    """Median seconds of a forward and backward pass of each of ``nets`` (name -> (module, params)), interleaved."""
    times: dict = {k: [] for k in nets}
    for _ in range(steps):
        for name, (net, params) in nets.items():
            for p in params:
                p.grad = None
            start = time.perf_counter()
            net(*inputs).backward()
            times[name].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="comma-separated: " + MODELS.replace(",", ", "))
    parser.add_argument("--calls", default=CALLS, help="comma-separated: " + CALLS.replace(",", ", ")
                        + " (router-logits on mixture-of-experts models only)")
    parser.add_argument("--batch-of-one", action="store_true", help="also plan the plain call at 50%% and call it "
                        "with a batch of 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; batch 8 x 128")
    print(f"{'model':9s} {'call':13s} {'eager peak':>12s} {'planned':>12s} {'ratio':>6s} {'time':>6s} gradients")

    def loss(out, y):
        return out

    for name in args.models.split(","):
        for call in args.calls.split(","):
            if call == "router-logits" and name not in ("mixtral", "qwen2_moe"):
                continue
            if name == "bert" and call in ("position-ids", "router-logits"):
                continue
            torch.manual_seed(0)
            model = Call(build(name), call).train()
            inputs = inputs_for(call, 8, 128)
            base = measure_training(*[fresh_copy(model)] * 2, inputs, None, loss, steps=1)
            m = fresh_copy(model)
            try:
                planned = memfit.optimize(m, inputs, "100%", strategy="none", loss_fn=lambda out: out,
                                          optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
            except memfit.TraceError as exc:
                print(f"{name:9s} {call:13s} {base.peak_bytes:>12,d} refused: {str(exc).splitlines()[0][:90]}")
                continue
            fig = measure_training(planned, planned, inputs, None, loss, steps=1)
            diff = compare(base, fig)["max_abs_grad_diff"]
            eager = fresh_copy(model)
            times = interleaved({"eager": (eager, list(eager.parameters())),
                                 "planned": (planned, list(m.parameters()))}, inputs)
            print(f"{name:9s} {call:13s} {base.peak_bytes:>12,d} {fig.peak_bytes:>12,d} "
                  f"{fig.peak_bytes / base.peak_bytes:>6.3f} {times['planned'] / times['eager']:>5.2f}x "
                  f"{'equal' if diff == 0 else f'max diff {diff:.1e}'}", flush=True)
        if args.batch_of_one:
            torch.manual_seed(0)
            model = Call(build(name), "plain").train()
            m = fresh_copy(model)
            try:
                planned = memfit.optimize(m, inputs_for("plain", 8, 128), "50%", loss_fn=lambda out: out,
                                          optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
            except memfit.InfeasibleBudgetError as exc:  # (the floor search is time-limited: a busy machine)
                print(f"  {name} at 50%: infeasible, smallest {exc.smallest_feasible_bytes:,d} B")
                continue
            one = inputs_for("plain", 1, 128)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                fig = measure_training(planned, planned, one, None, loss, steps=1)
            base = measure_training(*[fresh_copy(model)] * 2, one, None, loss, steps=1)
            unplanned = any("unplanned" in str(w.message) for w in seen)
            print(f"  {name} batch of 1 (planned for 8 at 50%): {fig.peak_bytes:,d} B, "
                  f"{fig.peak_bytes / planned.plan.budget_bytes:.2f} of the budget, "
                  f"{fig.peak_bytes / base.peak_bytes:.2f} of plain PyTorch's {base.peak_bytes:,d} B; "
                  f"{'ran UNPLANNED' if unplanned else 'ran the plan'}, gradients "
                  f"{'equal' if compare(base, fig)['gradients_match'] else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
