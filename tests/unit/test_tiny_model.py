"""Tests for scripts/make_tiny_model.py: the fixture model must load through the real HF path."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from scripts.make_tiny_model import build_tiny_model, split_into_shards

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def read_shards(model_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Map shard file name -> its tensors, read straight from disk (not through transformers)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    return out


def dir_bytes(model_dir: Path) -> dict[str, bytes]:
    """Every file's bytes, keyed by name, for byte-identity comparisons."""
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}


def load(model_dir: Path):
    """Load with loading info so tests can assert nothing was silently re-initialised."""
    return AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One default build shared by the read-only tests to keep the file fast."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_index_lists_every_tensor_once(default_model: Path) -> None:
    index = json.loads((default_model / "model.safetensors.index.json").read_text())
    shards = read_shards(default_model)

    assert len(shards) >= 2
    for name, tensors in shards.items():
        m = SHARD_RE.match(name)
        assert m and int(m.group(2)) == len(shards), name
        assert tensors, f"{name} is empty"

    seen: list[str] = [k for tensors in shards.values() for k in tensors]
    assert len(seen) == len(set(seen)), "a tensor is stored in more than one shard"
    assert index["weight_map"] == {k: name for name, tensors in shards.items() for k in tensors}
    total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert "lm_head.weight" in index["weight_map"]
    assert "model.layers.1.self_attn.q_proj.weight" in index["weight_map"]


def test_loads_with_no_missing_keys_and_matches_shards(default_model: Path) -> None:
    model, info = load(default_model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

    on_disk = {k: t for tensors in read_shards(default_model).values() for k, t in tensors.items()}
    state = model.state_dict()
    assert set(state) == set(on_disk)
    for k, t in on_disk.items():
        assert torch.equal(state[k], t), k
    # HF-style init: weights are random with std ~ initializer_range, not zeros or ones.
    assert 0.015 < on_disk["model.layers.0.mlp.up_proj.weight"].std().item() < 0.025


def test_forward_loss_is_near_uniform(default_model: Path) -> None:
    """A random tiny model should start at ~ln(vocab) loss, the baseline that training must beat."""
    model, _ = load(default_model)
    tok = AutoTokenizer.from_pretrained(default_model)
    ids = torch.tensor([tok("### Instruction:\nAdd the two numbers.\n\n### Response:\n47")["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - math.log(model.config.vocab_size)) < 0.5


def test_tokenizer_reloads_with_special_ids_matching_config(default_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_model)
    config = AutoConfig.from_pretrained(default_model)

    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.bos_token_id is not None
    assert len({tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}) == 3
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.bos_token_id,
    )
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert len(tok) <= config.vocab_size == 512

    text = "Below is an instruction that describes a task.\n\n### Instruction:\nReverse the word.\n\n### Response:\nn"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text) // 2, "BPE merges should compress the prompt template"
    assert tok.decode(tok("caf\u00e9 \u2603")["input_ids"]) == "caf\u00e9 \u2603"  # byte-level covers any text


def test_same_seed_is_byte_identical_and_seeds_differ(default_model: Path, tmp_path: Path) -> None:
    again = dir_bytes(build_tiny_model(tmp_path / "same"))
    assert again == dir_bytes(default_model)

    other = dir_bytes(build_tiny_model(tmp_path / "other", seed=1))
    assert other.keys() == again.keys()
    assert other["model-00001-of-00002.safetensors"] != again["model-00001-of-00002.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]  # tokenizer depends on data, not seed


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_each_arch_builds_and_loads(arch: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / arch, arch=arch, num_shards=3, seed=3)
    assert len(list(model_dir.glob("model-*-of-00003.safetensors"))) == 3

    model, info = load(model_dir)
    assert model.config.model_type == arch
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    keys = set(model.state_dict())
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (arch == "qwen2")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.in_features % 64 == 0 and module.out_features % 64 == 0, name


def test_tied_embeddings_omit_lm_head(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert all("lm_head.weight" not in t for t in read_shards(model_dir).values())

    model, info = load(model_dir)
    assert model.config.tie_word_embeddings is True
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.distributed
def test_bad_size_exits_nonzero_with_one_line_error(tmp_path: Path) -> None:
    out = tmp_path / "bad"
    script = REPO_ROOT / "scripts" / "make_tiny_model.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--output", str(out), "--hidden_size", "100", "--num_heads", "3"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "hidden_size" in lines[0] and "num_heads" in lines[0]
    assert not out.exists(), "validation must happen before anything is written"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 100, "num_heads": 3}, "divisible by --num_heads"),
        ({"hidden_size": 100, "num_heads": 20, "num_kv_heads": 4}, "must be even for rotary"),  # head_dim 5
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"vocab_size": 256}, "byte alphabet"),  # too small for 256 bytes + specials
        ({"num_heads": 3, "hidden_size": 192, "num_kv_heads": 2}, "divisible by --num_kv_heads"),
        ({"num_shards": 0}, "num_shards"),
        ({"num_shards": 1000}, "exceeds the number of tensors"),
        ({"arch": "gpt2"}, "arch"),
    ],
)
def test_bad_sizes_raise_before_writing(kwargs: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        build_tiny_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("sizes", [[10] * 8, [1000, 1, 1, 1, 1, 1, 1, 1000], [1, 1, 1, 1, 1, 1, 1, 5000]])
def test_split_into_shards_is_contiguous_and_nonempty(sizes: list[int], num_shards: int) -> None:
    assignment = split_into_shards(sizes, num_shards)
    assert len(assignment) == len(sizes)
    assert assignment[0] == 0 and assignment[-1] == num_shards - 1
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(assignment))
    assert set(assignment) == set(range(num_shards))
