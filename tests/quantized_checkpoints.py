"""Checkpoints in the quantized layouts the hub ships, made by transformers' own code from a dense model directory:
a pre-quantized bitsandbytes 4-bit one by `from_pretrained(..., BitsAndBytesConfig)` then `save_pretrained`, as the
`*-bnb-4bit` releases are made; an FP8 one with transformers' own FP8 quantizer op (its `Fp8Quantize`, what its
save path runs), each projection weight of the decoder layers float8 e4m3 with its `weight_scale_inv`, as the
DeepSeek-V3 and -FP8 releases lay them out, or with E8M0 scales and FP4 routed experts as DeepSeek-V4's does.
transformers' MXFP4 quantizer needs Triton on a GPU and it has no FP4 quantizer for FP8 checkpoints, so the gpt-oss
MXFP4 and DeepSeek-V4 FP4 writers here encode with transformers' e2m1 table in the releases' layouts, which
transformers' own loading then reads back (the tests compare against it). transformers 5 saves routed experts fused,
so a bitsandbytes MoE as transformers 4.x saved it (one Linear4bit per expert) is written with bitsandbytes' own
quantizer and QuantState serialization, as 4.x's save did."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
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


def fp8_checkpoint(dense: Path, out: Path, *, block: tuple[int, int] | None = (16, 16), scale_fmt: str = "float",
                   fp4_experts: bool = False) -> Path:  # fmt: skip
    """`dense` with every 2-D weight inside its decoder layers but the routers' quantized to FP8 (block-scaled, or
    one scale per tensor with `block` None; `scale_fmt` "ue8m0": E8M0 scales, which transformers' op rounds to powers
    of two), other tensors as they were; the shards and index keep their names. With `fp4_experts`, as DeepSeek-V4
    ships: the routed experts' weights FP4 (int8 bytes of two e2m1 values, one E8M0 scale per 32 values of a row),
    `expert_dtype: fp4` in config.json, and every weight's scales named `X.scale`."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt))
    quantize = Fp8Quantize(quantizer)

    def stored(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if fp4_experts and re.search(r"\.experts\.\d+\..*\.weight$", name):
            codes, exponents = e2m1_encode(tensor)
            return {name: codes.view(torch.int8), name.removesuffix("weight") + "scale":
                    exponents.view(torch.float8_e8m0fnu)}  # fmt: skip
        if tensor.ndim != 2 or ".layers." not in name or not name.endswith(".weight") or ".gate.weight" in name:
            return {name: tensor}
        parts = quantize._quantize_one(name, tensor)
        assert parts[name].dtype == torch.float8_e4m3fn, f"{name} {tuple(tensor.shape)} is not whole blocks"
        return {n.replace(".weight_scale_inv", ".scale") if fp4_experts else n: t for n, t in parts.items()}

    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": None if block is None else list(block), "scale_fmt": scale_fmt}  # fmt: skip
    # DeepSeek-V4 declares FP4 experts beside its quantization_config (V4.1 inside it).
    return _rewritten(dense, out, stored, quantization, expert_dtype="fp4" if fp4_experts else None)


def mxfp4_checkpoint(dense: Path, out: Path) -> Path:
    """A gpt-oss directory with its routed experts as gpt-oss ships them: each fused projection ([experts, in, out]
    in the model) as `_blocks` [experts, out, in/32, 16] (two e2m1 codes a byte, low nibble first) and `_scales`
    [experts, out, in/32] (exponents, bias 127), each block's scale the smallest power of two that fits it."""

    def stored(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {name: tensor}
        codes, exponents = e2m1_encode(tensor.transpose(1, 2))  # [experts, out, in]
        return {f"{name}_blocks": codes.view(*codes.shape[:-1], -1, 16), f"{name}_scales": exponents}

    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    return _rewritten(dense, out, stored, quantization)


def e2m1_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] weights as MXFP4: ([..., out, in/2] bytes of two e2m1 codes, low nibble first, [..., out,
    in/32] E8M0 exponents), each block of 32 scaled by the smallest power of two that fits it in e2m1's range and
    rounded to the nearest value of transformers' e2m1 table."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    blocks = weight.float().reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp(min=2**-100) / 6))
    codes = (blocks / exponent.exp2()).unsqueeze(-1).sub(torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    codes = codes.flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    return packed, (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()


def bnb_4bit_experts_checkpoint(dense: Path, out: Path, *, quant_type: str = "nf4", double_quant: bool = True) -> Path:
    """A mixture-of-experts `dense` (routed experts stored one linear per expert, `mlp.experts.E.gate_proj.weight`)
    as transformers 4.x saved it loaded in 4-bit: every linear of the decoder layers, routers included, one
    Linear4bit each, its packed bytes under the weight's name beside its QuantState as `QuantState.as_dict(packed=
    True)` lays it out (what Linear4bit's state dict holds), quantized by bitsandbytes' own `quantize_4bit` in blocks
    of 64 (the compute in fp32); everything else as it was."""
    import bitsandbytes.functional as bnbf

    def stored(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if tensor.ndim != 2 or ".layers." not in name or not name.endswith(".weight"):
            return {name: tensor}
        packed, state = bnbf.quantize_4bit(tensor.float(), blocksize=64, compress_statistics=double_quant,
                                           quant_type=quant_type, quant_storage=torch.uint8)  # fmt: skip
        return {name: packed} | {f"{name}.{key}": value for key, value in state.as_dict(packed=True).items()}

    quantization = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                    "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
                    "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
                    "llm_int8_skip_modules": None}  # fmt: skip
    return _rewritten(dense, out, stored, quantization)


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


def fp4_expert_digests(model: Path) -> dict[str, dict[str, str]]:
    """Each routed expert's FP4 bytes and E8M0 scales in a DeepSeek-V4 release (`...ffn.experts.E.w1/w2/w3`),
    digested straight from the file under the name of the per-expert layer that holds them: `...experts.gate_up.E`
    (w1 and w3, stacked as transformers fuses them) and `...experts.down.E` (w2)."""
    tensors = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for key in tensors:
        match = re.fullmatch(r"(model\.layers\.\d+)\.ffn\.experts\.(\d+)\.w1\.weight", key)
        if match is None:
            continue
        layer, expert = match.groups()
        for projection, sources in (("gate_up", ("w1", "w3")), ("down", ("w2",))):
            stem = f"{layer}.ffn.experts.{expert}"
            packed = torch.cat([tensors[f"{stem}.{w}.weight"].view(torch.uint8).flatten() for w in sources])
            scales = torch.cat([tensors[f"{stem}.{w}.scale"].view(torch.uint8) for w in sources])
            out[f"{layer}.mlp.experts.{projection}.{expert}"] = {"packed": tensor_digest(packed),
                                                                 "scales": tensor_digest(scales)}  # fmt: skip
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


def _rewritten(dense: Path, out: Path, stored: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
               quantization: dict, **config: object) -> Path:  # fmt: skip
    """`dense` written to `out` with each tensor as `stored(name, tensor)` gives it (one or more tensors, in the same
    shard; the index follows), config.json's quantization_config `quantization` and the other `config` keys not
    None, and the tokenizer beside it."""
    out.mkdir(parents=True)
    weight_map = {}
    for file in sorted(dense.glob("*.safetensors")):
        tensors = {k: v for name, tensor in load_file(file).items() for k, v in stored(name, tensor).items()}
        save_file(tensors, out / file.name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file.name)
    if (dense / "model.safetensors.index.json").is_file():
        index = json.loads((dense / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    settings = json.loads((dense / "config.json").read_text())
    settings |= {"quantization_config": quantization} | {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(json.dumps(settings, indent=2))
    _copy_tokenizer(dense, out)
    return out


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (source / name).is_file() and not (out / name).is_file():
            shutil.copy(source / name, out / name)
