"""LAMB against a hand computation, and an LR schedule that really moves step by step."""

import math

import pytest
import torch

from swarmd.job import OptimSpec
from swarmd.optim import Lamb, lr_at

torch.set_num_threads(1)


def test_lamb_first_step_by_hand():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    zero = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    w.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
    zero.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
    opt = Lamb([w, zero], lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    opt.step()
    # Step 1: bias correction makes m̂ = g and v̂ = g², so the Adam direction is g / (|g| + eps).
    u = [1 / (1 + 1e-6) + 0.01 * 3, 2 / (2 + 1e-6) + 0.01 * 4]
    trust = 5.0 / math.hypot(*u)  # ||w|| / ||u||
    assert w.tolist() == pytest.approx([3 - 0.1 * trust * u[0], 4 - 0.1 * trust * u[1]], rel=1e-12)
    # A zero tensor has no scale of its own: trust ratio 1, weight decay of 0 adds nothing.
    assert zero.tolist() == pytest.approx([-0.1 / (1 + 1e-6), 0.1 / (1 + 1e-6)], rel=1e-12)


def test_lamb_second_step_uses_moments():
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = Lamb([w], lr=0.5, betas=(0.5, 0.5), eps=1e-12)
    for g in (2.0, -1.0):
        w.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    # Step 1: m1 = 1, v1 = 2, m̂ = 2, v̂ = 4, update 1, trust |w|/|u| = 1: w = 1 - 0.5 = 0.5.
    # Step 2: m2 = 0.5·1 + 0.5·(-1) = 0, so the update is 0 and w stays.
    assert w.item() == pytest.approx(0.5)
    assert opt.state[w]["step"] == 2


def test_lamb_refuses_bad_hyperparameters():
    with pytest.raises(ValueError):
        Lamb([torch.nn.Parameter(torch.zeros(1))], lr=0)


def test_warmup_then_cosine_reaches_min_lr():
    spec = OptimSpec(lr=1.0, schedule="cosine", warmup_steps=4, min_lr=0.1)
    lrs = [lr_at(spec, 20, s) for s in range(21)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a > b for a, b in zip(lrs[4:20], lrs[5:21]))  # strictly decreasing after warmup
    assert lrs[20] == pytest.approx(0.1)
    assert lrs[12] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_linear_and_constant():
    linear = OptimSpec(lr=1.0, schedule="linear", min_lr=0.0)
    assert [lr_at(linear, 4, s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    constant = OptimSpec(lr=0.5, schedule="constant", warmup_steps=1)
    assert [lr_at(constant, 4, s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.5])
