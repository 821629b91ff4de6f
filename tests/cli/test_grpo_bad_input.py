"""Bad GRPO input through train.py's command line: exit status 2 and one `error:` line. Before the model loads (its
directory has a tokenizer but no weights): reward functions that cannot be found, rows without a prompt, a group
size that does not divide the batch, flags GRPO cannot take. During training, on 2 ranks: a reward function that
raises, or returns the wrong number of rewards, stops every rank with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import fire
import pytest

from qlora_fsdp.cli import preprocess
from tests.cli.test_bad_input import assert_one_line_error, run_cli
from tests.conftest import REPO_ROOT, launch, without_weights

PROMPTS = REPO_ROOT / "data" / "grpo_tiny.jsonl"
REWARDS = REPO_ROOT / "tests" / "grpo_rewards.py"
GOOD = f"{REWARDS}:token_sum"
TEMPLATE = REPO_ROOT / "tests" / "data" / "chat_templates" / "qwen_style.jinja"


@pytest.fixture(scope="module")
def no_weights(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return without_weights(tiny_model, tmp_path_factory.mktemp("no-weights") / "model")


def _broken_module(tmp_path: Path) -> str:
    (tmp_path / "broken_rewards.py").write_text("import no_such_package_here\n")
    return f"{tmp_path / 'broken_rewards.py'}:score"


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--reward_funcs", f"{REWARDS}:no_such_function"], ["grpo_rewards.py has no function 'no_such_function'"]),
        (["--reward_funcs", "no_such_module_anywhere:score"], ["no module 'no_such_module_anywhere'"]),
        (["--reward_funcs", "BROKEN"], ["does not import (ModuleNotFoundError", "no_such_package_here"]),
        (["--reward_funcs", "token_sum"], ["expected module.path:function"]),
        ([], ["--objective grpo needs --reward_funcs"]),
        (["--reward_funcs", GOOD, "--reward_weights", "1,2"], ["2 weight(s) for 1 reward function(s)"]),
        (["--reward_funcs", GOOD, "--batch_size", "6", "--num_generations", "4"],
         ["--batch_size 6 is not a multiple of --num_generations 4"]),
        (["--reward_funcs", GOOD, "--packing", "true"], ["--objective grpo cannot take --packing"]),
        (["--reward_funcs", GOOD, "--num_generations", "1"], ["--num_generations must be >= 2"]),
        (["--reward_funcs", GOOD, "--loss_type", "sapo"], ["--loss_type must be one of grpo, bnpo, dr_grpo, dapo"]),
        (["--reward_funcs", GOOD, "--eval_split", "0.1"], ["--objective grpo cannot take --eval_dataset or --eval"]),
        (["--reward_funcs", GOOD, "--max_completion_length", "64"], ["--context_length 64: a prompt and its"]),
        (["--objective", "dpo", "--num_generations", "4"], ["--num_generations does not apply to --objective dpo"]),
        (["--reward_funcs", GOOD, "--scale_rewards", "batch", "--gradient_accumulation_steps", "2"],
         ["--scale_rewards batch with --gradient_accumulation_steps above 1"]),
        (["--reward_funcs", GOOD, "--group_by_length", "true"], ["--objective grpo cannot take --group_by_length"]),
        (["--reward_funcs", GOOD, "--generation_mode", "gathered", "--fsdp_version", "1"],
         ["--generation_mode gathered with --fsdp_version 1", "use --fsdp_version 2"]),
        (["--reward_funcs", GOOD, "--generation_mode", "local"], ["--generation_mode must be one of sharded"]),
        (["--reward_funcs", GOOD, "--beta", "0.04", "--quant", "none", "--train_type", "full"],
         ["--train_type full", "grpo with --beta 0 need no reference"]),
    ],
)  # fmt: skip
def test_bad_flags_and_reward_functions(no_weights: Path, tmp_path: Path, flags: list[str],
                                        needles: list[str]) -> None:  # fmt: skip
    flags = [_broken_module(tmp_path) if flag == "BROKEN" else flag for flag in flags]
    code, errors, output = run_cli(["--model", str(no_weights), "--dataset", str(PROMPTS), "--objective", "grpo",
                                    "--context_length", "64", "--batch_size", "4", "--num_generations", "2",
                                    "--max_completion_length", "8", *flags, "--device", "cpu", "--output_dir",
                                    str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert_one_line_error(code, errors, output, *needles)


@pytest.mark.parametrize(
    ("rows", "needles"),
    [
        ([{"prompt": "Say hi."}, {"question": "Say hi."}], ["row 2", "each row needs 'prompt'"]),
        ([{"prompt": [{"role": "user", "content": "Hi"}]}, {"prompt": [{"role": "bot", "content": "x"}]}],
         ["row 2", "unknown role 'bot'"]),
        ([{"prompt": 3}], ["row 1", "'prompt' must be a string or a message list, got int"]),
    ],
)  # fmt: skip
def test_rows_without_a_prompt_name_the_file_and_row(no_weights: Path, tmp_path: Path, rows: list,
                                                    needles: list[str]) -> None:  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, errors, output = run_cli(["--model", str(no_weights), "--dataset", str(path), "--objective", "grpo",
                                    "--reward_funcs", GOOD, "--prompt_style", "chat", "--context_length", "64",
                                    "--chat_template", str(TEMPLATE),
                                    "--batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
                                    "--device", "cpu", "--output_dir", str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert_one_line_error(code, errors, output, *needles)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "needle"), [
    ("raises", "reward function raises raised RuntimeError: the grader is down"),
    ("too_few", "reward function too_few returned 3 rewards for 4 completions"),
])  # fmt: skip
def test_a_failing_reward_function_stops_every_rank(tiny_model: Path, tmp_path: Path, name: str, needle: str) -> None:
    out = tmp_path / "out"
    result = launch(REPO_ROOT / "train.py", ["--model", str(tiny_model), "--dataset", str(PROMPTS), "--objective",
                                              "grpo", "--reward_funcs", f"{REWARDS}:{name}", "--num_generations", "2",
                                              "--batch_size", "4", "--max_completion_length", "4", "--context_length",
                                              "64", "--quant", "bnb", "--device", "cpu", "--max_steps", "2",
                                              "--output_dir", str(out)], nproc=2, timeout=300)  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all(needle in e for e in errors), result.stderr[-3000:]  # one line from each rank
    assert "Traceback" not in result.stderr
    assert not (out / "adapter_model.safetensors").exists()


def test_preprocess_has_no_cache_to_build(no_weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--model", str(no_weights), "--dataset", str(PROMPTS), "--objective", "grpo", "--reward_funcs", GOOD,
            "--num_generations", "2", "--batch_size", "2", "--max_completion_length", "8", "--context_length", "64"]
    with pytest.raises(SystemExit) as stopped:
        fire.Fire(preprocess, command=args, name="preprocess.py")
    assert stopped.value.code == 2
    assert "error: --objective grpo reads its prompts whole when training starts" in capsys.readouterr().err
