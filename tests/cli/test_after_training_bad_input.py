"""Bad input to merge_adapter.py, export_quantized.py and generate.py: status 2, one `error:` line naming the flag,
no traceback, nothing written. In process (the scripts' main), plus one real interpreter launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import export_quantized, generate, merge_adapter
from scripts.make_tiny_model import build_tiny_model
from tests.conftest import REPO_ROOT, launch


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter of the tiny model, saved by PEFT as train.py saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("adapter")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(str(out))
    return out


def one_error(capsys: pytest.CaptureFixture, code: int, *needles: str) -> str:
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert code == 2, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert len(errors) == 1, captured.err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_merge_refuses_missing_directories(tiny_model: Path, adapter: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = merge_adapter.main(["--model", str(tiny_model), "--adapter", str(tmp_path / "nope"), "--output", str(out)])
    one_error(capsys, code, "--adapter", "nope")
    code = merge_adapter.main(["--model", str(tmp_path / "gone"), "--adapter", str(adapter), "--output", str(out)])
    one_error(capsys, code, "--model", "gone")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_merge_refuses_an_adapter_of_another_architecture_or_shape(
    adapter: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys
) -> None:
    fewer_layers = build_tiny_model(tmp_path_factory.mktemp("one-layer"), num_layers=1)
    narrower = build_tiny_model(tmp_path_factory.mktemp("narrow"), hidden_size=64, intermediate_size=128)
    out = tmp_path / "out"
    code = merge_adapter.main(["--model", str(fewer_layers), "--adapter", str(adapter), "--output", str(out)])
    one_error(capsys, code, "--adapter", "model.layers.1.", "another architecture")
    code = merge_adapter.main(["--model", str(narrower), "--adapter", str(adapter), "--output", str(out)])
    one_error(capsys, code, "--adapter", "another base model")
    assert not out.exists()


def test_output_holding_a_model_is_refused_unless_overwrite(tiny_model: Path, adapter: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    args = ["--model", str(tiny_model), "--adapter", str(adapter), "--output", str(out)]
    one_error(capsys, merge_adapter.main(args), "--output", "--overwrite")
    export = ["--model", str(tiny_model), "--quant", "bnb", "--output", str(out)]
    one_error(capsys, export_quantized.main(export), "--output", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "{}"
    assert merge_adapter.main([*args, "--overwrite", "true"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "staging directories left behind"


@pytest.mark.parametrize(
    ("script", "args", "needles"),
    [
        (export_quantized, ["--quant", "none", "--output", "{tmp}/out"], ("--quant none",)),
        (merge_adapter, ["--adapter", "{adapter}", "--output", "{tmp}/out", "--dtype", "int8"], ("--dtype", "int8")),
        (
            merge_adapter,
            ["--adapter", "{adapter}", "--output", "{tmp}/out", "--base_weights", "dequantized", "--quant", "none"],
            ("--base_weights dequantized",),
        ),
        (generate, [], ("--prompt", "--chat")),
        (generate, ["--prompt", "hi", "--quant", "gptq"], ("--quant", "gptq")),
        (generate, ["--prompt", "hi", "--prompt_style", "llama"], ("--prompt_style", "llama")),
        (generate, ["--prompt", "hi", "--adapter", "{tmp}/none"], ("--adapter",)),
        (generate, ["--prompt", "hi", "--max_new_token", "3"], ("--max_new_token",)),
    ],
    ids=["export-none", "merge-dtype", "merge-dequantized-none", "generate-no-prompt", "generate-quant", "style",
         "generate-adapter", "misspelt-flag"],
)  # fmt: skip
def test_bad_flags(script, args, needles, tiny_model: Path, adapter: Path, tmp_path: Path, capsys) -> None:
    filled = [a.format(tmp=tmp_path, adapter=adapter) for a in args]
    one_error(capsys, script.main(["--model", str(tiny_model), *filled]), *needles)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed
def test_a_real_launch_prints_one_line(tiny_model: Path, tmp_path: Path) -> None:
    """The same through the interpreter: nothing else on stderr, status 2."""
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--adapter", str(tmp_path / "missing"), "--output", str(out)]
    result = launch(REPO_ROOT / "scripts" / "merge_adapter.py", args, nproc=0, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(
        "error: --adapter"
    )
    assert not out.exists()
