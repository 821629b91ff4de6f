"""Checkpoints in the quantized layouts the hub ships, made by transformers' own code from a dense model directory:
a pre-quantized bitsandbytes 4-bit one by `from_pretrained(..., BitsAndBytesConfig)` then `save_pretrained`, as the
`*-bnb-4bit` releases are made; an FP8 one with transformers' own FP8 quantizer op (its `Fp8Quantize`, what its
save path runs), each projection weight of the decoder layers float8 e4m3 with its `weight_scale_inv`, as the
DeepSeek-V3 and -FP8 releases lay them out. transformers' MXFP4 quantizer needs Triton on a GPU, so the gpt-oss
MXFP4 writer here encodes with transformers' e2m1 table in the release's layout, which transformers' own loading
then reads back (the tests compare against it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qlora_fsdp.checkpoint.manifest import tensor_digest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def bnb_4bit_checkpoint(dense: Path, out: Path, *, quant_type: str = "nf4", double_quant: bool = True,
                        storage: torch.dtype = torch.uint8, dtype: torch.dtype = torch.float32) -> Path:  # fmt: skip
    """`dense` loaded in 4-bit by transformers and saved by it, the other weights and the compute in `dtype` (fp32
    by default, so its loss is exact to compare; the hub's releases: bf16)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_quant_storage=storage,
                                bnb_4bit_compute_dtype=dtype)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(dense, quantization_config=config, device_map="cpu", dtype=dtype)
    model.save_pretrained(out)
    _copy_tokenizer(dense, out)
    return out


def fp8_checkpoint(dense: Path, out: Path, *, block: tuple[int, int] | None = (16, 16)) -> Path:
    """`dense` with every 2-D weight inside its decoder layers but the routers' quantized to FP8 (block-scaled, or
    one scale per tensor with `block` None), other tensors as they were; the shards and index keep their names."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=block))
    quantize = Fp8Quantize(quantizer)
    out.mkdir(parents=True)
    weight_map = {}
    for file in sorted(dense.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(file).items():
            if tensor.ndim == 2 and ".layers." in name and not name.endswith(".gate.weight"):
                parts = quantize._quantize_one(name, tensor)
                assert parts[name].dtype == torch.float8_e4m3fn, f"{name} {tuple(tensor.shape)} is not whole blocks"
                tensors |= parts
            else:
                tensors[name] = tensor
        save_file(tensors, out / file.name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file.name)
    if (dense / "model.safetensors.index.json").is_file():
        index = json.loads((dense / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": None if block is None else list(block)}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(dense, out)
    return out


def mxfp4_checkpoint(dense: Path, out: Path) -> Path:
    """A gpt-oss directory with its routed experts as gpt-oss ships them: each fused projection ([experts, in, out]
    in the model) as `_blocks` [experts, out, in/32, 16] (two e2m1 codes a byte, low nibble first) and `_scales`
    [experts, out, in/32] (exponents, bias 127), each block's scale the smallest power of two that fits it."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    table = torch.tensor(FP4_VALUES)
    out.mkdir(parents=True)
    for file in sorted(dense.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(file).items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = tensor
                continue
            linear = tensor.float().transpose(1, 2)  # [experts, out, in]
            blocks = linear.reshape(*linear.shape[:2], -1, 32)
            exponent = torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp(min=2**-100) / 6))
            codes = (blocks / exponent.exp2()).unsqueeze(-1).sub(table).abs().argmin(-1).to(torch.uint8)
            tensors[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
            tensors[f"{name}_scales"] = (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()
        save_file(tensors, out / file.name, metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(dense, out)
    return out


def file_digests(model: Path) -> dict[str, dict[str, str]]:
    """Each pre-quantized layer's packed bytes and QuantState, digested straight from the file's tensors under the
    names the quantized layer holds them by."""
    tensors = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for key in tensors:
        if ".quant_state.bitsandbytes__" not in key:
            continue
        weight = key.split(".quant_state.")[0]
        extra = json.loads(bytes(tensors[key].tolist()).decode())
        digests = {"packed": tensor_digest(tensors[weight].view(torch.uint8).flatten()),
                   "absmax": tensor_digest(tensors[f"{weight}.absmax"]),
                   "code": tensor_digest(tensors[f"{weight}.quant_map"])}  # fmt: skip
        if f"{weight}.nested_absmax" in tensors:
            digests |= {"nested_absmax": tensor_digest(tensors[f"{weight}.nested_absmax"]),
                        "nested_code": tensor_digest(tensors[f"{weight}.nested_quant_map"]),
                        "offset": tensor_digest(torch.tensor(float(extra["nested_offset"])))}  # fmt: skip
        out[weight.removesuffix(".weight")] = digests
    return out


def mxfp4_digests(model: Path) -> dict[str, dict[str, str]]:
    """Each routed expert's MXFP4 blocks and scales, digested straight from the file under the name of the
    per-expert layer that holds them (`...experts.gate_up.E`)."""
    tensors = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for key, blocks in tensors.items():
        if key.endswith("_blocks"):
            fused = key.removesuffix("_blocks")
            prefix, _, projection = fused.rpartition(".")
            scales = tensors[f"{fused}_scales"]
            for e in range(blocks.shape[0]):
                out[f"{prefix}.{projection.removesuffix('_proj')}.{e}"] = {
                    "packed": tensor_digest(blocks[e].flatten()), "scales": tensor_digest(scales[e])}  # fmt: skip
    return out


def hqq_export(dense: Path, out: Path) -> Path:
    """scripts/export_quantized.py's HQQ output of `dense` (4 bits, groups of 64, fp32): HQQ's own qmodel.pt."""
    from scripts import export_quantized

    args = ["--model", str(dense), "--quant", "hqq", "--precision", "fp32", "--output", str(out)]
    assert export_quantized.main(args) == 0
    return out


def hqq_digests(model: Path) -> dict[str, dict[str, str]]:
    """Each layer of an HQQ qmodel.pt: its packed ints (as bytes), scale and zero, digested straight from the file."""
    saved = torch.load(model / "qmodel.pt", weights_only=True, mmap=True)
    return {name: {"packed": tensor_digest(entry["W_q"].flatten().view(torch.uint8)),
                   "scale": tensor_digest(entry["scale"]), "zero": tensor_digest(entry["zero"])}
            for name, entry in saved.items() if "W_q" in entry}  # fmt: skip


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (source / name).is_file() and not (out / name).is_file():
            shutil.copy(source / name, out / name)
