"""Bad preference input through train.py's command line (in this process, see test_bad_input.run_cli): exit status 2
and one `error:` line, before the model loads (its directory has a tokenizer but no weights, so an error about the
data or flags proves it came first)."""

from __future__ import annotations

import json
from pathlib import Path

import fire
import pytest

from qlora_fsdp.cli import preprocess
from tests.cli.test_bad_input import assert_one_line_error, run_cli
from tests.conftest import DATASET, REPO_ROOT, without_weights

PAIRS = REPO_ROOT / "data" / "preference_tiny.jsonl"
KTO = REPO_ROOT / "data" / "kto_tiny.jsonl"


@pytest.fixture(scope="module")
def no_weights(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return without_weights(tiny_model, tmp_path_factory.mktemp("no-weights") / "model")


def _pairs(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Loud."}
KTO_ROW = {"prompt": "Name a color.", "completion": "Blue.", "label": True}


@pytest.mark.parametrize(
    ("rows", "flags", "needles"),
    [
        ([GOOD, {"prompt": "p", "chosen": "a", "rejected": ["b"]}], ["--objective", "dpo"],
         ["row 2", "'prompt', 'chosen' and 'rejected' must be all strings or all message lists"]),
        ([GOOD, {"prompt": "p", "chosen": "a"}], ["--objective", "ipo"], ["row 2", "missing field 'rejected'"]),
        ([GOOD, {"instruction": "p", "output": "a"}], ["--objective", "simpo"], ["row 2", "a preference pair"]),
        ([GOOD], ["--objective", "sft"], ["row 1", "--objective dpo"]),
        ([{"prompt": "p", "chosen": "a", "rejected": "a"}, {"prompt": "q", "chosen": "b", "rejected": ""}],
         ["--objective", "orpo"], ["all 2 pairs were dropped (1 with identical replies, 1 with an empty one)"]),
        ([KTO_ROW, {"prompt": "p", "completion": "a"}], ["--objective", "kto"],
         ["row 2", "'label' must be true (desirable) or false (undesirable), got None"]),
        ([KTO_ROW, {**KTO_ROW, "label": "yes"}], ["--objective", "kto"], ["row 2", "'label' must be true", "'yes'"]),
        ([KTO_ROW, GOOD], ["--objective", "kto"], ["row 2", "reads unpaired completions, got a preference pair"]),
        ([KTO_ROW, {"completion": "a", "label": True}], ["--objective", "kto"], ["row 2", "a row without them"]),
        ([KTO_ROW, {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                    "completion": [{"role": "assistant", "content": "red"}], "images": ["red.png"], "label": True}],
         ["--objective", "kto"], ["row 2", "images are not supported by --objective kto"]),
    ],
)  # fmt: skip
def test_bad_pairs_name_the_file_and_row(no_weights: Path, tmp_path: Path, rows: list, flags: list[str],
                                         needles: list[str]) -> None:  # fmt: skip
    path = _pairs(tmp_path, rows)
    out = tmp_path / "out"
    code, errors, output = run_cli(["--model", str(no_weights), "--dataset", str(path), *flags, "--device", "cpu",
                                    "--output_dir", str(out)])  # fmt: skip
    assert code == 2
    assert_one_line_error(code, errors, output, *needles)
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--objective", "orpo", "--beta", "0.2"], ["--beta does not apply to --objective orpo", "--orpo_lambda"]),
        (["--objective", "ipo", "--label_smoothing", "0.1"], ["--label_smoothing does not apply to --objective ipo"]),
        (["--objective", "sft", "--simpo_gamma", "1"], ["--simpo_gamma does not apply to --objective sft"]),
        (["--objective", "dpo", "--packing", "true"], ["--objective dpo cannot take --packing"]),
        (["--objective", "simpo", "--precompute_reference", "true"], ["--precompute_reference", "simpo has none"]),
        (["--objective", "dpo", "--quant", "none", "--train_type", "full"], ["--train_type full", "adapters off"]),
        (["--objective", "ppo"], ["--objective 'ppo' is not one of sft, dpo, ipo, orpo, simpo, kto, grpo"]),
        (["--objective", "kto", "--packing", "true"], ["--objective kto cannot take --packing"]),
        (["--objective", "kto", "--quant", "none", "--train_type", "full"], ["--train_type full", "adapters off"]),
        (["--objective", "dpo", "--desirable_weight", "2"], ["--desirable_weight does not apply to --objective dpo"]),
        (["--objective", "kto", "--undesirable_weight", "0"], ["--undesirable_weight must be > 0"]),
        (["--objective", "dpo", "--beta", "0"], ["--beta must be > 0"]),
        (["--objective", "dpo", "--max_prompt_length", "-1"], ["--max_prompt_length must be >= 0"]),
        (["--objective", "dpo", "--router_aux_loss_coef", "0.01"], ["--objective dpo cannot take --router_aux_loss"]),
        (["--objective", "orpo", "--orpo_nll", "prompt"], ["--orpo_nll must be one of reply, sequence"]),
        (["--objective", "simpo", "--orpo_nll", "sequence"], ["--orpo_nll does not apply to --objective simpo"]),
        (["--objective", "orpo", "--orpo_nll", "sequence", "--sequence_parallel_size", "2"],
         ["--orpo_nll sequence cannot take --sequence_parallel_size above 1"]),
    ],
)
def test_flags_that_do_not_apply_are_refused(no_weights: Path, tmp_path: Path, flags: list[str],
                                             needles: list[str]) -> None:  # fmt: skip
    dataset = DATASET if "sft" in flags else KTO if "kto" in flags else PAIRS
    code, errors, output = run_cli(["--model", str(no_weights), "--dataset", str(dataset), *flags, "--device", "cpu",
                                    "--output_dir", str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert_one_line_error(code, errors, output, *needles)


def test_preprocess_builds_the_pairs_cache(no_weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """scripts/preprocess.py's command (fire over cli.preprocess) with --objective dpo builds the preference cache
    training then reuses."""
    args = ["--model", str(no_weights), "--dataset", str(PAIRS), "--objective", "dpo", "--dataset_cache_dir",
            str(tmp_path / "cache")]  # fmt: skip
    fire.Fire(preprocess, command=args, name="preprocess.py")
    out = capsys.readouterr().out
    assert "400 examples" in out and "built in" in out
