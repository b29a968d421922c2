"""Hugging Face transformers models (small configurations, random weights) planned by memfit: budget, predicted
against measured peak, step time against plain PyTorch's, and gradients against plain PyTorch's.

Their forward passes read sizes in Python code (``masking_utils``: ``if batch_size != position_ids.shape[0]:``),
so memfit traces them with the example batch's shapes (``memfit.graph.sized``). Each model is wrapped in a module
whose forward takes ``input_ids`` and ``labels`` and returns the loss (``use_cache=False``), as the README shows.
Batch 8 x 128 tokens, vocabulary 2000, hidden size 128, 4 layers; SGD with momentum; one thread. Needs
``pip install transformers`` (not a memfit dependency); written against transformers 5.25.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/transformers_models.py [--models llama,gpt2] [--budgets min,50%]
        [--short 5x128,8x96]

``--short``: after each plan, batches of other (smaller) shapes go through the planned module, as a short last
batch or a shorter sequence does: memfit traces the forward again for them and runs the plan's decisions on that
graph (``memfit.runtime.reshaped``). Printed: their measured peak against the plan's budget and plain PyTorch's peak
for those shapes, the gradients against PyTorch's, and the first step's time (which includes the trace).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import memfit
from memfit.bench.harness import compare, fresh_copy, measure_training

MODELS = "llama,qwen2,gpt2,bert,mixtral,qwen2_moe,deepseek_v3"


class CausalLM(torch.nn.Module):
    """``input_ids`` and ``labels`` in, the model's loss out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


class MaskedLM(CausalLM):
    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def build(name: str, vocab: int = 2000, hidden: int = 128, layers: int = 4) -> torch.nn.Module:
    """The wrapped model (train mode)."""
    import transformers as tf

    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": 4, "max_position_embeddings": 512}
    if name == "llama":
        return CausalLM(tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=2))).train()
    if name == "qwen2":
        return CausalLM(tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2))).train()
    if name == "gpt2":
        return CausalLM(tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4,
                                                         n_positions=512))).train()
    if name == "mixtral":  # (mixture of experts: 4 experts, 2 per token)
        return CausalLM(tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4,
                                                               num_experts_per_tok=2))).train()
    if name == "qwen2_moe":
        return CausalLM(tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2 * hidden,
            shared_expert_intermediate_size=2 * hidden))).train()
    if name == "deepseek_v3":  # (multi-head latent attention: a key shared across heads, expanded and copied in)
        return CausalLM(tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **common, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=2 * hidden, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, kv_lora_rank=64, q_lora_rank=None))).train()
    if name == "bert":
        return MaskedLM(tf.BertForMaskedLM(tf.BertConfig(**common))).train()
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="comma-separated: " + MODELS.replace(",", ", "))
    parser.add_argument("--budgets", default="min,50%", help="comma-separated memfit budgets")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--short", default="", help="comma-separated BATCHxTOKENS shapes to run after planning")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; batch {args.batch} x {args.tokens}")
    print(f"{'model':7s} {'budget':>6s} {'budget B':>12s} {'plain peak':>12s} {'predicted':>12s} {'measured':>12s} "
          f"{'meas/plain':>10s} {'overhead':>8s} {'plan s':>6s} gradients")

    def loss(out, y):  # (the wrapper returns the model's loss)
        return out

    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build(name)
        ids = torch.randint(0, 2000, (args.batch, args.tokens))
        inputs = (ids, ids.clone())
        base = measure_training(*[fresh_copy(model)] * 2, inputs, None, loss, steps=3)
        for budget in args.budgets.split(","):
            m = fresh_copy(model)
            start = time.time()
            try:
                planned = memfit.optimize(m, inputs, budget, loss_fn=lambda out: out,
                                          optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
            except memfit.InfeasibleBudgetError as exc:
                print(f"{name:7s} {budget:>6s} infeasible: smallest {exc.smallest_feasible_bytes:,d} B")
                continue
            seconds = time.time() - start
            fig = measure_training(planned, planned, inputs, None, loss, steps=3)
            same = compare(base, fig)
            plan = planned.plan
            values = "equal (1e-5)" if same["gradients_match"] else f"DIFFER {same['max_abs_grad_diff']:.1e}"
            print(f"{name:7s} {budget:>6s} {plan.budget_bytes:>12,d} {base.peak_bytes:>12,d} "
                  f"{plan.predicted_peak_bytes:>12,d} {fig.peak_bytes:>12,d} {fig.peak_bytes / base.peak_bytes:>10.2f} "
                  f"{fig.step_seconds / base.step_seconds:>7.2f}x {seconds:>6.0f} "
                  f"{values}; "
                  f"{'UNDER' if fig.peak_bytes <= plan.budget_bytes else 'OVER'} budget", flush=True)
            for shape in filter(None, args.short.split(",")):
                short(name, model, planned, plan, shape, loss)


def short(name: str, model: torch.nn.Module, planned: memfit.PlannedModule, plan: memfit.Plan, shape: str,
          loss) -> None:
    """Print a batch of ``shape`` ("BATCHxTOKENS") through ``planned``: its peak against the budget and plain
    PyTorch's, its gradients against PyTorch's, its first step's seconds (with the trace for its shapes) and the
    median step's."""
    batch, tokens = (int(v) for v in shape.split("x"))
    torch.manual_seed(1)
    ids = torch.randint(0, 2000, (batch, tokens))
    inputs = (ids, ids.clone())
    start = time.time()
    planned(*inputs).backward()  # (the first call of these shapes: traced again)
    first = time.time() - start
    planned.zero_grad(set_to_none=True)
    base = measure_training(*[fresh_copy(planned.model)] * 2, inputs, None, loss, steps=3)
    fig = measure_training(planned, planned, inputs, None, loss, steps=3)
    same = compare(base, fig)
    values = "equal (1e-5)" if same["gradients_match"] else f"DIFFER {same['max_abs_grad_diff']:.1e}"
    print(f"  {name} {shape}: measured {fig.peak_bytes:,d} B ({fig.peak_bytes / plan.budget_bytes:.2f} of the "
          f"budget, {fig.peak_bytes / base.peak_bytes:.2f} of plain PyTorch's {base.peak_bytes:,d} B), gradients "
          f"{values}, first step {first:.2f} s, step {fig.step_seconds:.3f} s ({fig.step_seconds / base.step_seconds:.2f}x "
          f"plain); {'UNDER' if fig.peak_bytes <= plan.budget_bytes else 'OVER'} budget", flush=True)


if __name__ == "__main__":
    main()
