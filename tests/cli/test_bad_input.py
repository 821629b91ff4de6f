"""Bad input to train.py: non-zero exit, one `error:` line naming the flag, no traceback, no output. The command
line runs in this process (fire over `qlora_fsdp.cli.main`, exactly as train.py calls it), so the tests pay the
imports once; the tests marked distributed launch the real interpreter where only a launch can show the point."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from unittest import mock

import fire
import pytest

from qlora_fsdp.cli import main
from tests.conftest import DATASET, LAUNCHER_VARS, launch, without_weights

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str]) -> tuple[int, list[str], str]:
    """`python train.py ARGS` in this process: its exit status, its `error:` lines and all it printed. No launcher
    variables: the run is one process, as `python train.py` is. An exception that escapes fails the test."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            fire.Fire(main, command=args, name="train.py")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    return code, errors, out.getvalue() + err.getvalue()


def assert_one_line_error(code: int, errors: list[str], output: str, *needles: str) -> str:
    assert code != 0
    assert "Traceback" not in output, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_nonexistent_model_path(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, errors, output = run_cli(["--model", str(tmp_path / "no-such-model"), "--output_dir", str(out)])
    assert_one_line_error(code, errors, output, "--model", "no-such-model")
    assert not out.exists()


def test_unknown_quant(tiny_model: Path) -> None:
    code, errors, output = run_cli(["--model", str(tiny_model), "--quant", "gptq"])
    assert_one_line_error(code, errors, output, "--quant", "gptq", "bnb, hqq, none")


def test_unsupported_hqq_bits(tiny_model: Path) -> None:
    code, errors, output = run_cli(["--model", str(tiny_model), "--quant", "hqq", "--hqq_bits", "5"])
    assert_one_line_error(code, errors, output, "--hqq_bits", "5", "1, 2, 3, 4, 8")


def test_several_bad_flags_reported_together(tiny_model: Path) -> None:
    code, errors, output = run_cli(["--model", str(tiny_model), "--quant", "gptq", "--batch_size", "0"])
    assert_one_line_error(code, errors, output, "--quant", "--batch_size")


def test_dataset_row_missing_output(tiny_model: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()[:6]]
    del rows[4]["output"]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--dataset", str(data), "--output_dir", str(out), "--device", "cpu"]
    code, errors, output = run_cli(args)
    assert_one_line_error(code, errors, output, "--dataset", str(data), "row 5", "'output'")
    assert not out.exists(), "a failed run must not leave an output directory behind"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_options(flag: str) -> None:
    code, _, output = run_cli([flag])
    assert code == 0
    for name in ("--model", "--quant", "--hqq_bits", "--lora_rank", "--sharding_strategy", "--log_to"):
        assert name in output


@pytest.mark.distributed
def test_a_real_launch_prints_help_and_one_error_line(tiny_model: Path) -> None:
    """What the in-process tests cannot show: train.py itself wires fire to the same main, and exits 2."""
    result = launch(REPO_ROOT / "train.py", ["--help"], nproc=0, timeout=60)
    assert result.returncode == 0 and "--sharding_strategy" in result.stdout
    result = launch(REPO_ROOT / "train.py", ["--model", str(tiny_model), "--quant", "gptq"], nproc=0, timeout=60)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert_one_line_error(result.returncode, errors, result.stdout + result.stderr, "--quant", "gptq")
    assert result.returncode == 2


def _quick_args(model: Path, out: Path) -> list[str]:
    return [
        "--model", str(model), "--dataset", str(DATASET), "--output_dir", str(out), "--device", "cpu",
        "--max_steps", "1", "--context_length", "64", "--precision", "fp32", "--log_to", "stdout",
    ]  # fmt: skip


def test_output_dir_with_finished_run_is_refused_unless_overwrite(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    code, errors, output = run_cli(_quick_args(tiny_model, out))
    assert_one_line_error(code, errors, output, "--output_dir", "--overwrite", "--resume_from")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n', "the previous run was touched"
    code, errors, output = run_cli([*_quick_args(tiny_model, out), "--overwrite", "true"])
    assert code == 0, output[-3000:]
    assert (out / "adapter_model.safetensors").exists()


def test_world_size_disagreeing_with_launcher(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, errors, output = run_cli([*_quick_args(tiny_model, out), "--world_size", "4"])
    assert_one_line_error(code, errors, output, "--world_size 4", "1 processes")
    assert not out.exists()


def test_context_shorter_than_prompt_template(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, errors, output = run_cli([*_quick_args(tiny_model, out), "--context_length", "8"])
    assert_one_line_error(code, errors, output, "--context_length")
    assert not out.exists()


def test_pickle_checkpoint_refused_unless_allowed(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(tiny_model, model)
    state = {}
    for shard in sorted(model.glob("*.safetensors")):
        state.update(load_file(shard))
        shard.unlink()
    (model / "model.safetensors.index.json").unlink()
    torch.save(state, model / "pytorch_model.bin")

    out = tmp_path / "out"
    code, errors, output = run_cli(_quick_args(model, out))
    assert_one_line_error(code, errors, output, "--model", "pytorch_model.bin", "--allow_pickle")
    assert not out.exists()
    code, errors, output = run_cli([*_quick_args(model, out), "--allow_pickle", "true"])
    assert code == 0, output[-3000:]
    assert (out / "adapter_model.safetensors").exists()


@pytest.mark.distributed
def test_hub_id_offline_names_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched: huggingface_hub reads HF_HUB_OFFLINE when it is imported."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    args = ["--model", "some-org/some-model", "--output_dir", str(tmp_path / "out")]
    result = launch(REPO_ROOT / "train.py", args, nproc=0, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    code, output = result.returncode, result.stdout + result.stderr
    assert_one_line_error(code, errors, output, "--model some-org/some-model", "hub", "local directory")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_offload_on_a_cpu_run(tiny_model: Path, tmp_path: Path, device: str) -> None:
    """Refused once the device is known: also when --device auto resolves to the CPU."""
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--cpu_offload", "true", "--device", device, "--output_dir", str(out)]
    code, errors, output = run_cli(args)
    assert_one_line_error(code, errors, output, "--cpu_offload")
    assert not out.exists()


@pytest.mark.parametrize("problem", ["no_chat_template", "unknown_role_in_mixture"])
def test_chat_data_errors_come_before_the_model_loads(tiny_model: Path, tmp_path: Path, problem: str) -> None:
    """The model directory has its tokenizer but no weights: an error about the data proves it came first."""
    model = without_weights(tiny_model, tmp_path / "no-weights")
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    if problem == "unknown_role_in_mixture":
        rows = [{"messages": turns}, {"messages": [*turns, {"role": "tool", "content": "{}"}]}]
        dataset, needles = f"{DATASET},{chat}", (f"--dataset {chat} row 2", "unknown role 'tool'")
    else:
        rows = [{"messages": turns}]
        dataset, needles = str(chat), (f"--dataset {chat} row 1", "no chat template", "--chat_template")
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code, errors, output = run_cli(["--model", str(model), "--dataset", dataset, "--output_dir", str(out)])
    assert code == 2
    assert_one_line_error(code, errors, output, *needles)
    assert not out.exists()
