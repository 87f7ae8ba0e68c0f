"""Backend choice of SpecFold's folded forward: bad values fail early with the field named (the
kernel backend itself is tested in tests/kernels/test_fold_fast.py, under the interpreter)."""

import pytest
import torch

from specfold_plugin.cli import main as specfold_main
from specfold_plugin.fold_fast import CapacityPlanner, first_overflow
from specfold_plugin.gate import gate
from specfold_plugin.specfold import FoldedVerify
from spiffy_plugin.errors import ConfigError


def test_bad_backend_fails_early():
    with pytest.raises(ConfigError, match="backend"):
        FoldedVerify(0.1, backend="cuda")
    with pytest.raises(ConfigError, match="gate_fn"):
        FoldedVerify(0.1, gate_fn=lambda h, p, d: gate(h, p, d), backend="triton")
    assert FoldedVerify(0.1, backend="triton").planner is not None
    with pytest.raises(ConfigError, match="capacity"):
        FoldedVerify(0.1, backend="triton", capacity="exact")
    with pytest.raises(SystemExit):
        specfold_main(["generate", "--model", "x", "--graph", "g.json", "--prompt", "a",
                       "--backend", "cuda"])


def test_capacity_planner_rounds_up_and_caps():
    p = CapacityPlanner(granule=16, margin=0.125)
    assert p.plan(3, 16, 2) == [(48, 48)] * 2  # nothing seen yet: every row
    p.update(3, 16, torch.tensor([[[17, 20], [40, 3]], [[16, 16], [48, 47]]]))  # [2, 2, 2 req]
    assert p.plan(3, 16, 2) == [(32, 48), (32, 48)]
    with pytest.raises(ConfigError, match="margin"):
        CapacityPlanner(margin=2)
    with pytest.raises(ConfigError, match="window"):
        CapacityPlanner(window=0)


def test_capacity_planner_takes_the_window_max():
    p = CapacityPlanner(granule=16, margin=0.0, window=2)
    seen = [[[[30], [10]], [[5], [5]]], [[[2], [40]], [[5], [5]]], [[[1], [1]], [[5], [5]]]]
    p.update(4, 16, torch.tensor(seen[0]))
    p.update(4, 16, torch.tensor(seen[1]))
    assert p.plan(4, 16, 2) == [(32, 48), (16, 16)]  # per layer and gate, max over both
    p.update(4, 16, torch.tensor(seen[2]))  # the first forward leaves the window
    assert p.plan(4, 16, 2) == [(16, 48), (16, 16)]
    assert p.plan(5, 16, 2) == [(80, 80)] * 2  # another branch count: nothing seen


def test_first_overflow_names_the_first_layer_over_its_plan():
    counts = torch.tensor([[[16], [16]], [[17], [3]], [[40], [40]]])  # [3 layers, 2, 1]
    assert first_overflow(counts, [(16, 16), (32, 32), (48, 48)]) is None
    assert first_overflow(counts, [(16, 16), (16, 32), (32, 48)]) == 1
    assert first_overflow(counts, [(16, 16), (32, 2), (48, 48)]) == 1  # the FFN gate's plan
    assert first_overflow(counts, [(16, 16), (32, 2), (48, 48)], "layer") is None
