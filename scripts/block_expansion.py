"""Llama-Pro block expansion: insert identity-initialised copies of decoder layers into a model checkpoint.

python scripts/block_expansion.py --model DIR --output DIR --expansion_rate 0.1

The layers are split into equal groups; after each group a copy of the group's last layer is inserted with its
attention output and MLP down projections set to zero. Through the residual connections the new block is then the
identity, so the expanded model computes exactly what the original does until the new blocks are trained
(`--train_type llama_pro` trains only them). Their indices are recorded in config.json as `llama_pro_new_layers`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.make_tiny_model import write_shards  # after the sys.path set-up above

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# The projections writing into the residual stream: zero them and the block adds nothing.
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
NEW_LAYERS_KEY = "llama_pro_new_layers"


def _read_state(model: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                state[key] = f.get_tensor(key)
    if not state:
        raise ValueError(f"--model {model}: no safetensors weights found")
    return state


def expand(model: Path, output: Path, expansion_rate: float) -> list[int]:
    """Write the expanded checkpoint to `output`; returns the indices of the new layers."""
    config = json.loads((model / "config.json").read_text())
    old_count = config["num_hidden_layers"]
    added = max(1, round(old_count * expansion_rate))
    if old_count % added:
        raise ValueError(f"--expansion_rate {expansion_rate}: {old_count} layers do not split into {added} groups")
    group = old_count // added
    state = _read_state(model)

    layers: dict[int, dict[str, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        match = LAYER_KEY.match(key)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            rest[key] = tensor

    expanded: dict[str, torch.Tensor] = dict(rest)
    new_indices = []
    index = 0
    for old in range(old_count):
        for name, tensor in layers[old].items():
            expanded[f"model.layers.{index}.{name}"] = tensor
        index += 1
        if (old + 1) % group == 0:
            for name, tensor in layers[old].items():
                copy = torch.zeros_like(tensor) if name in ZEROED else tensor.clone()
                expanded[f"model.layers.{index}.{name}"] = copy
            new_indices.append(index)
            index += 1

    output.mkdir(parents=True, exist_ok=True)
    for extra in model.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name != "model.safetensors.index.json":
            shutil.copy2(extra, output / extra.name)
    config["num_hidden_layers"] = index
    config[NEW_LAYERS_KEY] = new_indices
    if "layer_types" in config:
        config["layer_types"] = [config["layer_types"][0]] * index
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_shards(expanded, output, num_shards=max(2, math.ceil(len(expanded) / 64)))
    return new_indices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="model directory (config.json + safetensors)")
    parser.add_argument("--output", required=True, type=Path, help="where to write the expanded model")
    parser.add_argument("--expansion_rate", type=float, default=0.1, help="new layers as a fraction of the old")
    args = parser.parse_args(argv)
    try:
        new = expand(args.model, args.output, args.expansion_rate)
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: new layers {new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
