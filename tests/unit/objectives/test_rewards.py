"""Reward functions as GRPO loads and calls them (qlora_fsdp/objectives/rewards.py), in one process: TRL's call
(the dataset's other fields as columns, without the call's own names; `trainer_state` with the step), and each way
a function or its name can be wrong as one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.rewards import load_rewards, score
from qlora_fsdp.parallel.distributed import DistEnv

MODULE = '''
def by_column(completions, topic, trainer_state, **kwargs):
    return [float(len(t)) + trainer_state.global_step for t in topic]

def none_for_odd(completions, completion_ids, **kwargs):
    return [None if len(ids) % 2 else 1.0 for ids in completion_ids]

def huge(completions, **kwargs):
    return [10**400] * len(completions)

def array(completions, **kwargs):
    import numpy as np
    return np.zeros((len(completions), 3))

async def later(completions, **kwargs):
    return [0.0] * len(completions)
'''


@pytest.fixture()
def module(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(MODULE)
    return path


def _score(module: Path, names: str, **columns: list) -> np.ndarray:
    rewards = load_rewards(",".join(f"{module}:{n}" for n in names.split(",")))
    columns = {"topic": ["ab", "abc"], "completion_ids": ["not passed"], **columns}
    return score(rewards, prompts=["a", "b"], completions=["x", "yy"], completion_ids=[[1], [2, 3]], columns=columns,
                 step=7, env=DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")).numpy()  # fmt: skip


def test_trls_call_columns_step_and_none(module: Path) -> None:
    out = _score(module, "by_column,none_for_odd")
    assert out[:, 0].tolist() == [9.0, 10.0]  # len(topic) + the step; the dataset's completion_ids is not passed
    assert np.isnan(out[0, 1]) and out[1, 1] == 1.0


@pytest.mark.parametrize(("name", "needle"), [
    ("huge", "reward function huge returned [100000000000"),
    ("array", "reward function array returned array([[0., 0., 0.], [0., 0., 0.]]): expected a float or None each"),
])  # fmt: skip
def test_a_bad_return_is_one_line(module: Path, name: str, needle: str) -> None:
    with pytest.raises(UserError) as error:
        _score(module, name)
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("spec", "needle"), [
    ("MOD:later", "an async function"),
    ("MOD:by_column,OTHER:by_column", "names two functions 'by_column'"),
])  # fmt: skip
def test_async_and_twice_named_functions_are_refused(module: Path, tmp_path: Path, spec: str, needle: str) -> None:
    other = tmp_path / "other.py"
    other.write_text(MODULE)
    with pytest.raises(UserError, match=needle):
        load_rewards(spec.replace("MOD", str(module)).replace("OTHER", str(other)))
