"""The host-memory check before a CPU step (memfit.profile.host): a batch the machine cannot hold is refused with a
message instead of getting the process killed by the kernel."""

from __future__ import annotations

import torch
from torch import nn

from memfit.profile import host


def test_forward_output_bytes_counts_new_tensors_not_views_or_in_place_results():
    x = torch.randn(4, 8)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    # input 4*8, the two linear outputs 4*16 and 4*2, the ReLU's 4*16 (float32); the weights' transposes are views
    assert host.forward_output_bytes(model, (x,)) == 4 * (32 + 64 + 64 + 8)
    inplace = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(16, 2))
    assert host.forward_output_bytes(inplace, (x,)) == 4 * (32 + 64 + 8)
    # nothing of the model or its inputs changed (a meta forward, parameters swapped for the call only)
    assert all(p.device.type == "cpu" for p in model.parameters()) and x.device.type == "cpu"


def test_the_command_line_refuses_a_batch_beyond_the_available_memory_before_running(capsys, monkeypatch):
    from memfit import api
    from memfit.cli import main

    def profiled(*args, **kwargs):
        raise AssertionError("the step was profiled")

    monkeypatch.setattr(host, "available_host_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(api, "profile_graph", profiled)
    assert main(["plan", "--model", "resnet18", "--batch", "64", "--image-size", "64"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "more than the 64.0 MiB of memory this machine has available" in err and \
        "Lower --batch or --image-size" in err, err


def test_max_batch_does_not_run_a_probe_beyond_the_available_memory(monkeypatch):
    from memfit.bench.maxbatch import probe_batch
    from memfit.bench.sweep import zoo_workload

    monkeypatch.setattr(host, "available_host_bytes", lambda: 2**20)
    probe = probe_batch(zoo_workload("resnet18", 4, 32, "cpu", 0), "plain", 2**30)
    assert not probe.fits and probe.reason.startswith("not run: its forward makes"), probe


def test_max_batch_refuses_a_budget_batch_beyond_the_available_memory_before_measuring(capsys, monkeypatch):
    # a fresh user's `max-batch --budget-from-batch 100000 --image-size 128` ran 50 s at 20 GB before failing
    from memfit.bench import maxbatch
    from memfit.cli import main

    def measured(*args, **kwargs):
        raise AssertionError("plain PyTorch was measured")

    monkeypatch.setattr(host, "available_host_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(maxbatch, "plain_peak_bytes", measured)
    assert main(["max-batch", "--model", "resnet18", "--image-size", "64", "--budget-from-batch", "64"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Lower --budget-from-batch or --image-size" in err, err
