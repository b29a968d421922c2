"""``memfit bench`` and ``memfit max-batch`` on tiny models (the whole file takes well under 90 s on 2 cores).

Compiled code (``torch-budget``) is held to a gradient tolerance of 1e-4 (max abs difference after the
harness's 3 SGD steps), not 1e-5: AOTAutograd's decompositions (BatchNorm, ...) sum in another order.
"""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
from torch import nn

from memfit.bench import peers
from memfit.bench.harness import measure_training
from memfit.bench.maxbatch import largest_fitting, max_batch, parse_strategy
from memfit.bench.sweep import Workload, parse_fractions, sweep, write_results
from memfit.cli import main

REPORT_KEYS = {"model", "batch_size", "input_shape", "device", "strategy", "budget_bytes", "baseline",
               "planned", "overhead", "solve_seconds", "profile_and_solve_seconds", "mip_gap", "decisions",
               "regions", "gradients_match", "max_abs_grad_diff", "bn_stats_match", "budget_fraction",
               "backend", "error"}
PLANNED_KEYS = {"peak_bytes", "activation_peak_bytes", "predicted_peak_bytes", "step_seconds",
                "predicted_step_seconds"}
BASELINE_KEYS = {"peak_bytes", "fixed_bytes", "activation_peak_bytes", "step_seconds"}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).train()


def small_work(batch: int, model: nn.Module | None = None) -> Workload:
    gen = torch.Generator().manual_seed(batch)
    images = torch.randn(batch, 3, 24, 24, generator=gen)
    target = torch.randint(0, 10, (batch,), generator=gen)
    return Workload("small_cnn", model if model is not None else small_cnn(), (images,), target,
                    nn.functional.cross_entropy)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    baseline, rows = sweep(small_work(8), budgets=[1.0, 0.5, 0.001],
                           strategies=["none", "chen", "memfit", "torch-budget", "rockmate"], steps=1,
                           torch_budgets=[1.0, 0.0])
    paths = write_results(rows, baseline, out, title="test")
    return baseline, rows, paths


def test_parse_fractions():
    assert parse_fractions("100%,70%,0.5") == [1.0, 0.7, 0.5]
    with pytest.raises(ValueError):
        parse_fractions("half")


def test_sweep_writes_documented_files_and_keys(swept):
    baseline, rows, paths = swept
    data = json.loads(paths["json"].read_text())
    assert len(data) == len(rows) == 1 + 1 + 3 + 2 + 1  # none, chen, memfit x3, torch-budget x2, rockmate
    for r in data:
        assert REPORT_KEYS <= set(r), REPORT_KEYS - set(r)
        assert BASELINE_KEYS <= set(r["baseline"])
        if r["planned"] is not None:
            assert PLANNED_KEYS <= set(r["planned"])
            assert r["planned"]["peak_bytes"] == (r["baseline"]["fixed_bytes"]
                                                  + r["planned"]["activation_peak_bytes"])
            assert r["overhead"] > 0
    assert {(r["strategy"], r["backend"]) for r in data} == {
        ("none", "eager"), ("chen", "eager"), ("memfit", "eager"), ("torch-budget", peers.AOT_EAGER),
        ("rockmate", "rockmate")}
    memfit = {r["budget_fraction"]: r for r in data if r["strategy"] == "memfit"}
    act, fixed = baseline.activation_peak_bytes, baseline.fixed_bytes
    assert memfit[0.5]["budget_bytes"] == fixed + int(0.5 * act)  # budgets are of the ACTIVATION peak
    with open(paths["csv"]) as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows)
    assert {"strategy", "backend", "budget_fraction", "planned.peak_bytes", "overhead",
            "error"} <= set(table[0])
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_memfit_rows_fit_and_match(swept):
    _, rows, _ = swept
    for r in rows:
        if r["backend"] == "eager" and r["planned"] is not None:
            assert r["gradients_match"] and r["bn_stats_match"], r
            if r["budget_bytes"] is not None:
                assert r["under_budget"], r


def test_infeasible_budget_is_a_row_not_an_error(swept):
    _, rows, _ = swept
    (r,) = [r for r in rows if r["strategy"] == "memfit" and r["budget_fraction"] == 0.001]
    assert r["planned"] is None and "no plan fits" in r["error"]
    assert r["smallest_feasible_bytes"] > r["budget_bytes"]


def test_torch_budget_gradients_match_plain(swept):
    _, rows, _ = swept
    tb = [r for r in rows if r["strategy"] == "torch-budget"]
    assert [r["budget_fraction"] for r in tb] == [1.0, 0.0]
    for r in tb:
        assert r["error"] is None, r["error"]
        assert r["backend"] == peers.AOT_EAGER and r["compiled_graphs"] == 1
        assert r["max_abs_grad_diff"] <= 1e-4 and r["gradients_match"] and r["bn_stats_match"], r
        check = r["one_step_grad_check"]
        assert check["within_float32_noise"] and check["max_abs_grad_diff"] <= 1e-4, check
    import torch._functorch.config as functorch_config

    assert functorch_config.activation_memory_budget == 1.0  # reset after the sweep


def test_rockmate_row_says_why(swept):
    _, rows, _ = swept
    ok, why = peers.rockmate_status("cpu")
    assert not ok
    (r,) = [r for r in rows if r["strategy"] == "rockmate"]  # one row when it cannot run
    assert r["error"] == why and r["planned"] is None and r["backend"] == "rockmate"


def test_largest_fitting_search():
    probes = []

    def fits(b):
        probes.append(b)
        return b <= 37

    assert largest_fitting(fits, 1, 4096) == (37, 38)
    assert probes[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert largest_fitting(lambda b: True, 1, 100) == (100, None)
    assert largest_fitting(lambda b: False, 4, 100) == (0, 1)
    assert parse_strategy("torch-budget:0.3") == ("torch-budget", 0.3)
    with pytest.raises(ValueError):
        parse_strategy("chen:0.5")


def test_max_batch_is_measured_and_tight():
    model = small_cnn()
    ref = small_work(6, model)
    m = copy.deepcopy(model)
    plain_peak = measure_training(m, m, ref.inputs, ref.target, ref.loss_fn, steps=1).peak_bytes
    budget = plain_peak + 1
    results = max_batch(lambda b: small_work(b, model), budget, ["chen", "memfit"])
    assert [r.strategy for r in results] == ["plain", "chen", "memfit"]
    for r in results:
        best, nxt = r.probe(r.max_batch), r.probe(r.next_batch)
        assert r.max_batch >= 1 and best.fits and best.peak_bytes <= budget
        assert r.next_batch == r.max_batch + 1 and not nxt.fits
        assert nxt.peak_bytes is None or nxt.peak_bytes > budget
        d = r.to_dict()
        assert d["max_batch"] == r.max_batch and d["peak_bytes"] == best.peak_bytes
    plain = results[0]
    assert plain.max_batch >= 6  # the budget is plain PyTorch's own peak at batch 6
    # the answer holds when measured again from scratch, and the next batch does not fit
    m = small_cnn()
    w = small_work(plain.max_batch + 1, m)
    assert measure_training(m, m, w.inputs, w.target, w.loss_fn, steps=1).peak_bytes > budget


def test_cli_bench_and_max_batch(tmp_path, capsys):
    out = tmp_path / "b"
    rc = main(["bench", "--model", "resnet18", "--batch", "2", "--image-size", "32", "--strategies",
               "none,memfit", "--budgets", "100%,1%", "--out", str(out), "--steps", "1"])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())
    assert [(r["strategy"], r["budget_fraction"]) for r in rows] == [("none", None), ("memfit", 1.0),
                                                                     ("memfit", 0.01)]
    assert rows[2]["error"] and (out / "results.csv").exists() and (out / "pareto.png").exists()
    text = capsys.readouterr().out
    assert "ACTIVATION" in text and "infeasible" in text
    js = tmp_path / "mb.json"
    rc = main(["max-batch", "--model", "resnet18", "--image-size", "32", "--budget", "160MiB", "--strategies",
               "", "--start-batch", "2", "--json", str(js)])
    assert rc == 0
    rep = json.loads(js.read_text())
    (plain,) = rep["results"]
    assert plain["strategy"] == "plain"
    assert plain["peak_bytes"] <= rep["budget_bytes"] < plain["next_peak_bytes"]
