"""``memfit bench`` and ``memfit max-batch`` on tiny models (the whole file takes well under 90 s on 2 cores).

Compiled code (``torch-budget``) is held to a gradient tolerance of 1e-4 (max abs difference after the
harness's 3 SGD steps), not 1e-5: AOTAutograd's decompositions (BatchNorm, ...) sum in another order.
"""

from __future__ import annotations

import copy
import csv
import json
import tempfile

import pytest
import torch
from torch import nn

from memfit.bench import peers
from memfit.bench.harness import measure_training
from memfit.bench.maxbatch import (
    BudgetBelowFixedError,
    largest_fitting,
    max_batch,
    model_fixed_bytes,
    parse_strategy,
)
from memfit.bench.sweep import Workload, parse_fractions, parse_strategies, sweep, write_results
from memfit.cli import main
from memfit.solve.plan import Plan

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
    assert parse_fractions("50%,30%,") == [0.5, 0.3]  # a trailing comma is fine
    assert parse_fractions("100%,50%,100%") == [1.0, 0.5]  # a repeated budget is measured once
    assert parse_strategies("memfit,chen,memfit") == ["memfit", "chen"]  # and a repeated strategy
    with pytest.raises(ValueError, match="empty entry"):  # a fresh user's typo was silently dropped
        parse_fractions("50%,,30%")
    with pytest.raises(ValueError, match="no budgets"):
        parse_fractions("")
    # `memfit bench --budgets`: a fresh user's 0.5 was answered "e.g. '0.5%'", and 0% was accepted
    with pytest.raises(ValueError, match="e.g. '50%'"):
        parse_fractions("0.5", percent_only=True)
    with pytest.raises(ValueError, match=r"must be in \(0, 100\]"):  # as `memfit run` refuses it
        parse_fractions("150%,50%")
    with pytest.raises(ValueError, match="above 0%"):  # (a fresh user's nan% failed only after profiling)
        parse_fractions("nan%", percent_only=True)
    with pytest.raises(ValueError, match="above 0%"):
        parse_fractions("0%", percent_only=True)
    with pytest.raises(ValueError, match="such as '50%'$"):
        parse_fractions("min", percent_only=True)


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


def test_the_rounding_check_tells_float32_rounding_from_an_error():
    """The one-step check of plans that round differently: another float32 computation of the same step (from the
    batch moved by float32's precision) is within its noise, gradients and BatchNorm statistics; a gradient 1% off
    or statistics moved by 1e-3 are not. Its noise is at least plain float32's own distance from float64."""
    import torch.nn.functional as F

    from memfit.bench.harness import fresh_copy

    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 10)).train()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    ref = peers.reference_grads(model, (x,), y, F.cross_entropy)
    plain = max(float((ref.grads32[k].double() - ref.grads64[k]).abs().max()) for k in ref.grads32)
    assert ref.grads_noise >= plain and ref.buffers_noise > 0
    m = fresh_copy(model)
    buffers: dict = {}
    grads = peers.one_step_grads(m, m, (x * (1 + 1.2e-7 * torch.randn_like(x)),), y, F.cross_entropy, 0, buffers)
    check = peers.one_step_check(grads, ref, buffers)
    assert check["within_float32_noise"] and check["buffers_within_float32_noise"], check
    wrong = dict(grads, **{"4.weight": grads["4.weight"] * 1.01})
    assert not peers.one_step_check(wrong, ref, buffers)["within_float32_noise"]
    moved = dict(buffers, **{"1.running_mean": buffers["1.running_mean"] + 1e-3})
    assert not peers.one_step_check(grads, ref, moved)["buffers_within_float32_noise"]


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
    probes.clear()
    assert largest_fitting(lambda b: fits(b) and False, 4, 100) == (0, 4)  # nothing below the start
    assert probes == [4]
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


def test_max_batch_never_probes_below_the_start_and_says_why_none_fits(tmp_path, capsys):
    model = small_cnn()  # BatchNorm: batch 1 would fail in training, so the search starts at 2
    fixed, detail = model_fixed_bytes(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fixed == 3 * params + sum(b.numel() * b.element_size() for b in model.buffers())
    # a budget at the fixed bytes: refused before any probe, naming them
    with pytest.raises(BudgetBelowFixedError, match=f"fixed bytes, {fixed} bytes") as info:
        max_batch(lambda b: small_work(b, model), fixed, ["memfit"])
    assert info.value.fixed_bytes == fixed and "gradients" in detail
    # just above them: even batch 2 does not fit; one probe per strategy, none at batch 1
    results = max_batch(lambda b: small_work(b, model), fixed + 1, ["memfit"], start=1)
    for r in results:
        assert r.max_batch == 0 and r.next_batch == 2 == r.start_batch
        assert [p.batch for p in r.probes] == [2]
        why = r.why_not()
        assert why.startswith("batch 2 does not fit: ") and "the fixed bytes alone are" in why, why
        assert r.to_dict()["why_not"] == why
    assert "measured peak" in results[0].why_not() and "infeasible" in results[1].why_not()
    # the CLI: a budget below a zoo model's fixed bytes is a user error (exit 2) naming them
    rc = main(["max-batch", "--model", "mobilenet_v2", "--image-size", "32", "--budget", "10MB",
               "--strategies", "memfit"])
    err = " ".join(capsys.readouterr().err.split())  # (rich wraps lines)
    assert rc == 2 and "fixed bytes, 26977048 bytes (25.7 MiB)" in err, err


def test_cli_bench_refuses_an_unknown_strategy_before_it_starts(tmp_path, capsys):
    """Found by a fresh user: ``--strategies foo`` drew an empty progress bar ("0/None") before its error."""
    rc = main(["bench", "--model", "resnet18", "--batch", "2", "--image-size", "32", "--strategies", "none,foo",
               "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 2 and "unknown strategy 'foo'" in " ".join(out.err.split()), out.err
    assert "memfit bench" not in out.out and "None" not in out.out, out.out


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


# --------------------------------------------------------------------------------------------------
# offloading (vDNN) through the CLI and the harness
# --------------------------------------------------------------------------------------------------

RUN_KEYS = (REPORT_KEYS - {"budget_fraction", "backend", "error"}) | {"offload_store"}


def _run(tmp_path, *flags) -> tuple[int, dict]:
    """``memfit run`` on resnet18 at its tiny size; the exit status and the JSON report."""
    from memfit import zoo

    batch, size = zoo.tiny_size("resnet18")
    js = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
    rc = main(["run", "--model", "resnet18", "--batch", str(batch), "--image-size", str(size), "--steps", "1",
               "--json", str(js), *flags])
    return rc, json.loads(js.read_text())


def test_cli_run_vdnn_all_offloads_to_the_disk_store(tmp_path, capsys):
    off = tmp_path / "offload"  # created by memfit
    rc, r = _run(tmp_path, "--strategy", "vdnn-all", "--offload-dir", str(off))
    assert rc == 0
    assert RUN_KEYS <= set(r) and PLANNED_KEYS | {"host_peak_bytes"} <= set(r["planned"])
    assert r["gradients_match"] and r["bn_stats_match"], r
    assert r["decisions"]["offload"] > 0
    assert r["planned"]["host_peak_bytes"] > 0
    assert r["offload_store"] == f"disk:{off}"
    assert off.is_dir() and list(off.iterdir()) == []  # the files are unlinked as soon as they are made
    assert "host peak" in capsys.readouterr().out


def test_cli_run_memfit_with_and_without_offload(tmp_path):
    off = tmp_path / "offload"
    rc, r = _run(tmp_path, "--strategy", "memfit", "--offload-dir", str(off))
    assert rc == 0 and r["gradients_match"] and r["bn_stats_match"], r
    assert r["buffers_compared"] > 0  # ResNet-18's BatchNorm statistics were compared
    assert r["offload_store"] == f"disk:{off}"
    host = r["planned"]["host_peak_bytes"]
    assert isinstance(host, int) and (host > 0) == (r["decisions"]["offload"] > 0)
    rc, r = _run(tmp_path, "--strategy", "chen", "--no-offload")
    assert rc == 0 and r["offload_store"] is None and r["planned"]["host_peak_bytes"] == 0
    assert r["decisions"]["offload"] == 0


def test_cli_run_says_there_were_no_buffers_to_compare_rather_than_match(tmp_path, capsys, monkeypatch):
    # fresh-user finding: VGG-16 (no BatchNorm, no buffers) was reported "BatchNorm statistics: match"
    from memfit import zoo

    monkeypatch.setenv("COLUMNS", "240")  # rich wraps the table's cells to the terminal's width

    batch, size = zoo.tiny_size("vgg16")
    js = tmp_path / "vgg.json"
    rc = main(["run", "--model", "vgg16", "--batch", str(batch), "--image-size", str(size), "--steps", "1",
               "--strategy", "chen", "--json", str(js)])
    r = json.loads(js.read_text())
    assert rc == 0 and r["gradients_match"] and r["buffers_compared"] == 0, r
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "BatchNorm statistics" in line]
    assert len(rows) == 1 and "none (the model has no buffers)" in rows[0] and "match" not in rows[0], rows
    # fresh-user finding P4: the total peaks, in GiB beside activations in MiB, read the same before and after a
    # saving; every memory row is now in the activation peak's unit, and the title says which budget was asked for
    import re

    cells = {line.split("│")[1].strip(): re.findall(r"([\d.]+) (\w+)", line) for line in out.splitlines()
             if line.count("│") >= 4 and line.split("│")[1].strip() in ("total peak", "activation peak")}
    units = {u for _, u in cells["total peak"]}
    assert len(units) == 1 and len(cells["total peak"]) == 3, cells
    (plain, _), (planned, _) = cells["total peak"][:2]
    unit = 1024 ** ["B", "KiB", "MiB", "GiB"].index(units.pop())
    saved = (r["baseline"]["peak_bytes"] - r["planned"]["peak_bytes"]) / unit
    resolution = 10.0 ** -len(plain.split(".")[1])
    assert abs((float(plain) - float(planned)) - saved) <= 1.01 * resolution, (cells, saved)
    assert resolution * unit <= r["baseline"]["activation_peak_bytes"] / 10, (cells, r["baseline"])  # it shows
    words = " ".join(out.split())  # (rich wraps the title and the caption to the table's width)
    assert "budget min = " in words and "(not read by chen)" in words, out
    assert "the fixed bytes are" in words, out  # VGG-16 here: nearly all parameters
    # fresh-user finding P6: on a loaded machine the predicted seconds sat far below the measured ones, unexplained;
    # the overhead row now has its predicted ratio, and a step far from its profiled time says so
    from rich.console import Console

    from memfit.cli import _report_table

    def render(report):
        console = Console(width=240, record=True)
        console.print(_report_table(report, "min"))
        return console.export_text()

    pred = r["planned"]["predicted_step_seconds"] / r["baseline"]["predicted_step_seconds"]
    overhead = next(line for line in render(r).splitlines() if "│ overhead" in line)
    assert f"{pred:.2f}x" in overhead.split("│")[4], overhead
    slow = json.loads(json.dumps(r))
    slow["baseline"]["step_seconds"] = 2 * r["baseline"]["predicted_step_seconds"]
    assert "measured 2.00x its profiled time" in " ".join(render(slow).split())
    slow["baseline"]["step_seconds"] = r["baseline"]["predicted_step_seconds"]
    assert "its profiled time" not in render(slow)
    # with a rounding check (row stripes, conv-native) of a model without buffers: no statistics row above "none"
    slow["rounding_check"] = {"vs_float64": 1e-7, "float32_noise": 1e-7, "buffers_vs_float64": 0.0,
                              "buffers_float32_noise": 0.0}
    table = render(slow)
    assert "one step vs float64" in table and "its BatchNorm statistics" not in table, table
    slow["buffers_compared"] = 3
    assert "its BatchNorm statistics" in render(slow)
    # fresh-user finding: --strategy none --budget 1% printed a peak 100x its budget with nothing flagged
    slow["planned"]["peak_bytes"] = r["budget_bytes"] + 1
    table = " ".join(render(slow).split())
    assert "(over the budget)" in table and "the chen strategy does not plan to a budget" in table, table
    slow["planned"]["peak_bytes"] = r["budget_bytes"]
    assert "over the" not in render(slow)


def test_cli_run_grads_exist_reaches_baseline_plan_and_measurement(tmp_path):
    # with gradients preallocated, each one is computed into a temporary and added into .grad, and every
    # gradient is live from the start of the backward: plain PyTorch's measured peak grows (ResNet-18's
    # 45 MB of gradients dwarf its activations at this size) while the fixed bytes stay the same
    rc, off = _run(tmp_path, "--strategy", "chen", "--no-offload")
    rc2, on = _run(tmp_path, "--strategy", "chen", "--no-offload", "--grads-exist")
    assert rc == 0 and rc2 == 0
    assert off["grads_exist"] is False and on["grads_exist"] is True
    assert on["gradients_match"] and on["bn_stats_match"], on
    assert on["baseline"]["fixed_bytes"] == off["baseline"]["fixed_bytes"]
    assert on["baseline"]["peak_bytes"] > off["baseline"]["peak_bytes"]
    assert on["baseline"]["activation_peak_bytes"] > off["baseline"]["activation_peak_bytes"]
    # the planner used the same convention as the measurement: its prediction is close to the measured peak
    # (ignoring the flag on either side would be off by about the difference above)
    gap = on["baseline"]["peak_bytes"] - off["baseline"]["peak_bytes"]
    assert abs(on["planned"]["predicted_peak_bytes"] - on["planned"]["peak_bytes"]) < gap / 10


def test_cli_bench_and_max_batch_grads_exist(tmp_path):
    out = tmp_path / "b"
    rc = main(["bench", "--model", "resnet18", "--batch", "2", "--image-size", "32", "--strategies", "none",
               "--out", str(out), "--steps", "1", "--grads-exist"])
    assert rc == 0
    (row,) = json.loads((out / "results.json").read_text())
    assert row["grads_exist"] is True and row["gradients_match"], row
    # plain PyTorch measured and the `none` plan predicted with gradients preallocated (both ~19 MB above
    # what they are without the flag)
    assert abs(row["planned"]["predicted_peak_bytes"] - row["baseline"]["peak_bytes"]) < 2**20
    js = tmp_path / "mb.json"
    budget = row["baseline"]["peak_bytes"]
    rc = main(["max-batch", "--model", "resnet18", "--image-size", "32", "--budget", str(budget), "--strategies",
               "", "--start-batch", "2", "--batch-limit", "3", "--json", str(js), "--grads-exist"])
    assert rc == 0
    rep = json.loads(js.read_text())
    assert rep["grads_exist"] is True and rep["results"][0]["max_batch"] == 2  # batch 2 is the budget


def test_cli_offload_flag_errors_are_messages(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for flags, words in [(["--strategy", "vdnn-all", "--offload-dir", str(not_a_dir)], "not a directory"),
                         (["--strategy", "vdnn-conv", "--no-offload"], "contradicts"),
                         (["--offload-dir", str(tmp_path), "--no-offload"], "not allowed with")]:
        with pytest.raises(SystemExit) as exc:
            main(["run", "--model", "resnet18", "--batch", "2", "--image-size", "32", *flags])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err
    rc = main(["bench", "--model", "resnet18", "--batch", "2", "--image-size", "32", "--strategies", "vdnn-all",
               "--no-offload", "--out", str(tmp_path / "b")])
    assert rc == 2 and "contradicts" in capsys.readouterr().err


def test_cli_plan_out_and_threads_errors_are_messages_before_solving(tmp_path, capsys):
    """Found by fresh-user runs: ``memfit plan --out <a folder>`` solved, then died with a traceback; ``--threads 0``
    was taken; ``memfit run --json <a folder>`` was offered ``plan.json`` as the report's name."""
    for flags, words in [(["plan", "--out", str(tmp_path)], "names a folder"),
                         (["plan", "--out", str(tmp_path / "new") + "/"], "names a folder"),
                         (["plan", "--out", "/proc/memfit-nope.json"], "cannot write there"),
                         (["plan", "--threads", "0"], ">= 1"),
                         (["run", "--threads", "0"], ">= 1"),
                         (["run", "--json", str(tmp_path)], "e.g. " + str(tmp_path / "run.json"))]:
        with pytest.raises(SystemExit) as exc:
            main([*flags[:1], "--model", "resnet18", "--batch", "2", "--image-size", "32", *flags[1:]])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err


def test_cli_plan_and_run_agree_on_the_figures(tmp_path, capsys):
    """Found by a fresh-user run: ``memfit plan`` left the labels out of the fixed bytes (and assumed a loss), so
    the smallest feasible budget it named was 40 bytes under the one ``memfit run`` needed, which refused it.

    Without variants, so that both keep every activation as PyTorch does: with them, each command chooses by its own
    measured times, and a compact max-pool measured faster by one of them moved its peak by 57,344 bytes (a CI run)."""
    args = ["--model", "resnet18", "--batch", "2", "--image-size", "32", "--threads", "1", "--no-variants"]
    assert main(["plan", *args, "--budget", "100%", "--out", str(tmp_path / "p.json")]) == 0
    plan = Plan.load(tmp_path / "p.json")
    js = tmp_path / "run.json"
    assert main(["run", *args, "--budget", "100%", "--steps", "1", "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    capsys.readouterr()
    assert plan.predicted_peak_bytes == report["planned"]["predicted_peak_bytes"], (plan, report["planned"])
    assert plan.budget_bytes == report["budget_bytes"]


def test_no_variants_help_says_what_it_turns_off(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help lines (and breaks them at hyphens)
    for command in ("run", "plan", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "turn off operator variants" in text and "ablation" not in text, text
        assert "in-place ReLUs and additions" in text
        # every one of them takes --no-offload (train too, since it gained the offload flags)
        assert "with --no-offload as well it equals the remat-ilp strategy" in text and "--no-offload" in text


def test_default_bench_strategies_offload_only_where_it_is_on():
    from memfit.bench.sweep import BENCH_STRATEGIES, default_strategies

    assert default_strategies("cpu") == list(BENCH_STRATEGIES)
    with_vdnn = default_strategies("cpu", "/some/dir")
    assert {"vdnn-all", "vdnn-conv"} <= set(with_vdnn) and set(BENCH_STRATEGIES) <= set(with_vdnn)
    assert default_strategies("cuda") == with_vdnn
    assert default_strategies("cuda", offload=False) == list(BENCH_STRATEGIES)


def test_sweep_with_offload_store(tmp_path):
    off = tmp_path / "offload"
    baseline, rows = sweep(small_work(8), budgets=[1.0, 0.9], strategies=["vdnn-all", "vdnn-conv", "memfit"],
                           steps=1, offload_dir=str(off))
    assert [(r["strategy"], r["budget_fraction"]) for r in rows] == [
        ("vdnn-all", None), ("vdnn-conv", None), ("memfit", 1.0), ("memfit", 0.9)]  # vDNN reads no budget
    for r in rows:
        assert r["error"] is None and r["gradients_match"] and r["bn_stats_match"], r
        assert r["offload_store"] == f"disk:{off}"
        assert (r["planned"]["host_peak_bytes"] > 0) == (r["decisions"]["offload"] > 0)
    assert rows[0]["planned"]["host_peak_bytes"] > 0
    paths = write_results(rows, baseline, tmp_path / "out", title="offload")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "planned.host_peak_bytes" in paths["csv"].read_text().splitlines()[0]


def _offload_gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_gpu_check.py"
    spec = importlib.util.spec_from_file_location("offload_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offload_gpu_check_smoke_on_cpu(tmp_path, capsys, monkeypatch):
    check = _offload_gpu_check()
    out = tmp_path / "check.json"
    temp = tmp_path / "temp"  # where its temporary disk-store directory goes; it must remove it
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    rows = check.main(["--device", "cpu", "--tiny", "--models", "vgg16,resnet18", "--strategies",
                       "none,vdnn-conv,memfit", "--budgets", "100%", "--out", str(out)])
    assert list(temp.iterdir()) == []
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert [(r["model"], r["strategy"]) for r in rows] == [
        (m, s) for m in ("vgg16", "resnet18") for s in ("plain", "none", "vdnn-conv", "memfit")]
    for r in rows:
        assert "error" not in r, r
        assert r["peak_bytes"] > 0 and r["step_seconds"] > 0
        if r["strategy"] != "plain":
            assert r["gradients_match"], r
        assert (r["host_peak_bytes"] > 0) == (r.get("decisions", {}).get("offload", 0) > 0)
    assert rows[2]["host_peak_bytes"] > 0  # vgg16 vdnn-conv
    assert len(capsys.readouterr().out.splitlines()) >= len(rows)

    # plain PyTorch out of memory at the asked batch: its peak is extrapolated from two smaller batches
    real_plain = check.Check.plain

    def plain(self, b):
        if b == self.batch:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_plain(self, b)

    monkeypatch.setattr(check.Check, "plain", plain)
    rows = check.main(["--device", "cpu", "--tiny", "--models", "vgg16", "--batch", "8", "--strategies", "none",
                       "--out", str(out)])
    (r,) = rows
    assert r["plain_extrapolated"] and r["plain_measured_at"] == [4, 2] and r["gradients_match"] is None
    report = json.loads(out.read_text())
    assert "extrapolated linearly" in report["notes"][0]
    assert "extrapolated linearly" in capsys.readouterr().out


def test_torch_budgets_are_knob_values_not_percentages():
    # a fresh user's `--torch-budgets 1.5` was told to write '1.5%', which then ran knob 0.015
    from memfit.bench.sweep import parse_knobs

    assert parse_knobs("1.0,0.5, 0") == [1.0, 0.5, 0.0]
    for bad in ("1.5", "50%", "x", ""):
        with pytest.raises(ValueError, match="--torch-budgets"):
            parse_knobs(bad)


@pytest.mark.parametrize("knob", ["7", "abc", ""])
def test_max_batch_refuses_a_torch_budget_knob_out_of_range(knob, capsys):
    # a fresh user's `--strategies torch-budget:7` failed inside torch.compile, reported "max batch 0" and exited 0
    from memfit.cli import main

    rc = main(["max-batch", "--model", "resnet18", "--image-size", "32", "--budget", "200MiB",
               "--strategies", f"torch-budget:{knob}", "--batch-limit", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "a plain number from 0 to 1" in err, err


@pytest.mark.parametrize("budget, given", [("min", "'min'"), ("40%", "a percentage")])
def test_max_batch_refuses_a_budget_that_is_not_bytes_saying_which(budget, given, capsys):
    # a fresh user's `--budget min` was told it was "not a percentage"
    from memfit.cli import main

    rc = main(["max-batch", "--model", "resnet18", "--image-size", "32", "--budget", budget, "--batch-limit", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and f"needs a budget in bytes ('2GiB', '512MB'), not {given}" in err, err


def test_max_batch_refuses_a_limit_below_the_start_before_measuring(capsys, monkeypatch):
    # a fresh user's --start-batch 64 --batch-limit 8 measured plain PyTorch at --budget-from-batch first
    from memfit.bench import maxbatch
    from memfit.cli import main

    def measured(*args, **kwargs):
        raise AssertionError("plain PyTorch was measured before the flags were checked")

    monkeypatch.setattr(maxbatch, "plain_peak_bytes", measured)
    rc = main(["max-batch", "--model", "resnet18", "--image-size", "32", "--budget-from-batch", "4",
               "--start-batch", "64", "--batch-limit", "8"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "--batch-limit 8 is below --start-batch 64" in err, err


@pytest.mark.parametrize("flags, said", [
    (["--strategies", "memfit,foo"], "unknown max-batch strategy 'foo'"),
    (["--budget-from-batch", "0"], "--budget-from-batch 0: the batch whose plain PyTorch peak is the budget must be"),
    (["--start-batch", "1", "--batch-limit", "1"], "--batch-limit 1 is below the start batch 2 (resnet18 has BatchNorm"),
    (["--start-batch", "100000"], "--batch-limit 4096 (its default) is below --start-batch 100000"),
])
def test_max_batch_checks_its_flags_before_measuring(capsys, monkeypatch, flags, said):
    # each was told only after plain PyTorch had been measured at --budget-from-batch, or without naming the flag
    from memfit.bench import maxbatch
    from memfit.cli import main

    def measured(*args, **kwargs):
        raise AssertionError("plain PyTorch was measured before the flags were checked")

    monkeypatch.setattr(maxbatch, "plain_peak_bytes", measured)
    args = ["max-batch", "--model", "resnet18", "--image-size", "32"]
    if "--budget-from-batch" not in flags:
        args += ["--budget-from-batch", "4"]
    assert main(args + flags) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert said in err, err


def test_the_command_lines_infeasible_budget_advice_fits_what_it_can_change(capsys, monkeypatch):
    # a fresh user was told to try "an optimizer with less state such as SGD", which the command line cannot set
    from memfit.cli import main

    assert main(["plan", "--model", "resnet18", "--batch", "2", "--image-size", "32", "--budget", "50%",
                 "--time-limit", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "fixed bytes alone" in err and "always trains the whole model with SGD and momentum 0.9" in err
    assert "lower --batch" not in err  # the parameters alone are over that budget
    # where the input batch is what takes the fixed bytes over the budget, --batch is named among the flags
    from memfit import cli
    from memfit.solve.strategies import InfeasibleBudgetError

    def refuse(args):
        raise InfeasibleBudgetError(900, 1500, 1000, input_bytes=400).for_optimizer("SGD", 100)

    monkeypatch.setattr(cli, "cmd_plan", refuse)
    assert main(["plan", "--model", "resnet18", "--budget", "900"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lower the batch size" in err and "momentum 0.9: lower --batch, raise --budget" in err, err


def test_the_float64_step_decides_where_float32_is_beyond_its_noise(monkeypatch):
    """Where a plan's float32 step is beyond plain float32's noise (rounding amplified: the zoo's ResNet-50 at
    2 x 32 px, gradients of 1e10), the step is run in float64 under the plan: a correct plan equals plain
    PyTorch's float64 step there, and a gradient 1% off does not."""
    import torch.nn.functional as F

    import memfit
    from memfit.bench.harness import fresh_copy
    from memfit.bench.job import rounding_check, rounding_verdict
    from memfit.runtime.planned import PlannedModule

    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).train()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    plan, _, _ = memfit.plan(fresh_copy(model), x, budget="min", loss_fn=lambda out: F.cross_entropy(out, y))
    check = peers.one_step_check

    def unlucky(*args, **kwargs):  # float32 as if amplified beyond its noise runs
        return dict(check(*args, **kwargs), within_float32_noise=False)

    monkeypatch.setattr(peers, "one_step_check", unlucky)
    one = rounding_check(model, plan, (x,), y, F.cross_entropy)
    assert one["float64_gradients_match"] and one["float64_buffers_match"], one
    assert one["float64_grads_rel"] <= 1e-12, one
    assert rounding_verdict(one)["gradients_match"] and rounding_verdict(one)["bn_stats_match"]
    step = peers.one_step_grads

    def off(module, *args, **kwargs):  # the plan's weight gradient 1% off, in float32 and float64 alike
        grads = step(module, *args, **kwargs)
        if isinstance(module, PlannedModule):
            grads = {k: v * 1.01 if k.endswith("6.weight") else v for k, v in grads.items()}
        return grads

    monkeypatch.setattr(peers, "one_step_grads", off)
    wrong = rounding_check(model, plan, (x,), y, F.cross_entropy)
    assert not wrong["float64_gradients_match"] and not rounding_verdict(wrong)["gradients_match"], wrong


def test_a_long_plot_title_stays_inside_the_figure(tmp_path):
    # a fresh user's pareto.png had its title (model, sizes, budgets, machine) cut at the right edge
    from types import SimpleNamespace

    from memfit.bench.plots import pareto_plot

    rows = [{"strategy": "memfit", "budget_fraction": f, "overhead": 1 + f / 10,
             "planned": {"activation_peak_bytes": int(f * 2**24)}} for f in (0.5, 0.33)]
    title = "memfit bench: resnet50, batch 8, 128x128 on cpu, " + ", ".join(f"{p}%" for p in range(100, 0, -3))
    fig = pareto_plot(rows, SimpleNamespace(activation_peak_bytes=2**24), tmp_path / "p.png", title=title)
    box = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


def test_every_command_line_flag_has_help():
    # a fresh user found --strategy, --device, --seed, --out, --epochs and --lr without a line in --help
    from memfit.cli import build_parser

    _, sub = build_parser()
    missing = {name: [a.option_strings[0] for a in p._actions if a.option_strings and not a.help]
               for name, p in sub.choices.items()}
    assert not any(missing.values()), missing
