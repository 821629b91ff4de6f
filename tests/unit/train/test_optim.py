"""qlora_fsdp.train.optim: the warmup + decay multiplier, the LambdaLR built on it, and which parameters AdamW sees."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from qlora_fsdp.config.options import OptimConfig
from qlora_fsdp.train.optim import build_optimizer, build_scheduler, lr_factor

TOTAL = 20
WARMUP_RATIO = 0.1
FLOOR = 0.1


def expected_factors(schedule: str, *, total: int, warmup_ratio: float, floor: float) -> list[float]:
    """The schedule from its definition, written out independently of the package.

    Warmup lasts ceil(ratio * total) steps (ratio taken as the decimal the user typed), rising (step + 1) / warmup;
    afterwards progress = (step - warmup) / (total - warmup) runs from 0 towards 1 and the decay is
    1 (constant), 1 - progress (linear), or floor + (1 - floor) * (1 + cos(pi * progress)) / 2 (cosine).
    """
    warmup = math.ceil(Fraction(str(warmup_ratio)) * total)
    out = []
    for step in range(total):
        if step < warmup:
            out.append((step + 1) / warmup)
            continue
        progress = (step - warmup) / (total - warmup)
        if schedule == "constant":
            out.append(1.0)
        elif schedule == "linear":
            out.append(1.0 - progress)
        else:
            out.append(floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2.0)
    return out


def cfg_for(schedule: str, **kw: object) -> OptimConfig:
    values = dict(lr_scheduler=schedule, warmup_ratio=WARMUP_RATIO, cosine_min_lr_ratio=FLOOR, lr=1e-3, wd=0.0)
    values.update(kw)
    return OptimConfig(**values)  # type: ignore[arg-type]


def test_hand_written_values_of_the_reference() -> None:
    # Spot values worked out on paper for 20 steps, 2 warmup steps, floor 0.1: guards the reference itself.
    cos = expected_factors("cosine", total=TOTAL, warmup_ratio=WARMUP_RATIO, floor=FLOOR)
    lin = expected_factors("linear", total=TOTAL, warmup_ratio=WARMUP_RATIO, floor=FLOOR)
    assert cos[:3] == [0.5, 1.0, 1.0]
    assert cos[11] == pytest.approx(0.55)  # progress 9/18 = 0.5: halfway between floor and 1
    assert lin[11] == pytest.approx(0.5)
    assert lin[19] == pytest.approx(1 / 18)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_factor_step_by_step(schedule: str) -> None:
    factor = lr_factor(cfg_for(schedule), TOTAL)
    expected = expected_factors(schedule, total=TOTAL, warmup_ratio=WARMUP_RATIO, floor=FLOOR)
    got = [factor(step) for step in range(TOTAL)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_no_warmup_starts_at_full_lr(schedule: str) -> None:
    factor = lr_factor(cfg_for(schedule, warmup_ratio=0.0), TOTAL)
    expected = expected_factors(schedule, total=TOTAL, warmup_ratio=0.0, floor=FLOOR)
    assert factor(0) == 1.0
    assert [factor(s) for s in range(TOTAL)] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_cosine_floor_is_respected() -> None:
    factor = lr_factor(cfg_for("cosine", cosine_min_lr_ratio=0.25), TOTAL)
    values = [factor(s) for s in range(TOTAL)]
    assert min(values[2:]) >= 0.25
    assert values[2:] == sorted(values[2:], reverse=True)


@pytest.mark.parametrize(("warmup_ratio", "total"), [(0.1, 30), (0.3, 10), (0.07, 100), (0.14, 50), (0.55, 100)])
def test_warmup_length_is_the_exact_fraction(warmup_ratio: float, total: int) -> None:
    """7% of 100 steps is 7 warmup steps, not 8.

    The count must not depend on float rounding: in binary, 0.07 * 100 is 7.000000000000001.
    """
    warmup = math.ceil(Fraction(str(warmup_ratio)) * total)
    factor = lr_factor(cfg_for("constant", warmup_ratio=warmup_ratio), total)
    # The last warmup step reaches the full rate and the next step stays there.
    assert factor(warmup - 1) == 1.0, [factor(s) for s in range(warmup + 1)]
    assert factor(0) == pytest.approx(1 / warmup)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_scheduler_drives_real_optimizer_steps(schedule: str) -> None:
    """LambdaLR sets lr = base * factor(step) before every step, and AdamW really moves by about that lr.

    With a constant gradient, Adam's bias-corrected m / sqrt(v) is sign(g), so each step moves every weight by
    lr (minus a negligible eps effect): the parameter change is a direct read-out of the rate that was used.
    """
    base = 1e-2
    cfg = cfg_for(schedule, lr=base)
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    optimizer = build_optimizer([weight], cfg)
    scheduler = build_scheduler(optimizer, cfg, TOTAL)
    expected = expected_factors(schedule, total=TOTAL, warmup_ratio=WARMUP_RATIO, floor=FLOOR)
    grad = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    for step in range(TOTAL):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(base * expected[step], rel=1e-12)
        before = weight.detach().clone()
        weight.grad = grad.clone()
        optimizer.step()
        scheduler.step()
        moved = before - weight.detach()
        assert torch.allclose(moved, torch.sign(grad) * base * expected[step], rtol=1e-5, atol=0), (step, moved)


def test_build_optimizer_takes_only_trainable_params() -> None:
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(5))
    frozen2 = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    cfg = OptimConfig(lr=3e-4, wd=0.01)
    optimizer = build_optimizer(iter([frozen, a, frozen2, b]), cfg)  # a one-shot iterator, like model.parameters()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert [id(p) for p in group["params"]] == [id(a), id(b)]
    assert group["lr"] == 3e-4
    assert group["weight_decay"] == 0.01


def test_frozen_params_never_change() -> None:
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    bias_before = model.bias.detach().clone()
    optimizer = build_optimizer(model.parameters(), OptimConfig(lr=0.1))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert torch.equal(model.bias, bias_before)
    assert not torch.equal(model.weight.grad, torch.zeros_like(model.weight))
    assert len(optimizer.state) == 1
