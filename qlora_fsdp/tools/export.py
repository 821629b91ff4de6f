"""After training: merge an adapter into its base model, or write the base quantized exactly as training did.

Both load the base the way training does (`model.build_skeleton` + `model.stream_weights`, through the training
backend for quantized weights), so "the weights training used" is not re-implemented here. Each decoder layer is
written out and freed as soon as it is whole, into safetensors shards of at most SHARD_BYTES: peak host memory is
about one output shard, one layer and the embeddings, never the whole model. Every input is checked before anything
is written; results go to a staging directory that is renamed into place at the end.

With the adapter's manifest (qlora_fsdp/checkpoint/manifest.py), the base is quantized where training quantized it (CUDA
when training did and a GPU is visible) and each quantized layer must match training's digests before any of it is
written: a mismatch stops the script and the staging directory is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qlora_fsdp.checkpoint.manifest import MANIFEST_FILE, intra_op_threads, read_manifest
from qlora_fsdp.compat import experts_flags, revert_weight_conversion
from qlora_fsdp.config.options import ModelConfig, QuantConfig
from qlora_fsdp.data.images import load_image_inputs
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats import kept_experts_layer
from qlora_fsdp.model.hub import INDEX_FILE, SINGLE_FILE, resolve_model_path
from qlora_fsdp.model.skeleton import Skeleton, build_skeleton
from qlora_fsdp.model.streaming import checkpoint_targets, stream_weights
from qlora_fsdp.parallel.precision import PRECISIONS, quant_compute_dtype
from qlora_fsdp.quant import QuantBackend, make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import QuantizedExperts, fused_order, peft_wrapper_depth
from qlora_fsdp.tools.config import OUTPUT_DTYPES, ExportConfig, MergeConfig
from qlora_fsdp.train.metrics import peak_memory_bytes

SHARD_BYTES = 1 << 30
"""Largest output shard: what a merge or export holds in memory besides one layer and the embeddings."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
HQQ_WEIGHTS = "qmodel.pt"
MODEL_FILES = ("config.json", SINGLE_FILE, INDEX_FILE, HQQ_WEIGHTS, ADAPTER_WEIGHTS)
_ADAPTER_KEY = re.compile(r"^base_model\.model\.(.+)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)$")


@dataclass
class LoraWeights:
    """One adapted linear layer: W + scaling * B @ A, rescaled per output row by DoRA's magnitude if present."""

    a: torch.Tensor
    b: torch.Tensor
    magnitude: torch.Tensor | None = None


@dataclass
class Adapter:
    path: Path
    scaling: float
    layers: dict[str, LoraWeights]
    """Adapted module name (as in the base model) -> its weights."""
    target_parameters: list[str] = field(default_factory=list)
    """PEFT's `target_parameters` (routed experts' fused projections), as the adapter config lists them."""
    experts: dict[str, LoraWeights] = field(default_factory=dict)
    """Fused experts parameter name -> its per-expert weights (PEFT's layout), once check_adapter has seen the
    model: A [rank x experts, in], B [out, rank x experts]."""


@dataclass
class Written:
    """What a merge or export produced, for the closing line of the scripts."""

    output: Path
    seconds: float
    peak_bytes: int

    def summary(self, what: str) -> str:
        return (
            f"{what} written to {self.output} in {self.seconds:.1f} s; "
            f"peak host memory {self.peak_bytes / 2**20:.0f} MiB"
        )


def read_adapter(name: str) -> Adapter:
    """A PEFT LoRA/DoRA adapter directory as train.py saves it; anything this merge would get wrong is refused."""
    path = Path(name).expanduser()
    if not path.is_dir():
        raise UserError(f"--adapter {name}: no such directory; pass the directory train.py saved the adapter to")
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / f).is_file()]
    if missing:
        raise UserError(f"--adapter {name}: no {missing[0]}; pass the directory train.py saved the adapter to")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    unsupported = [
        (config.get("peft_type") != "LORA", f"peft_type {config.get('peft_type')!r} (only LoRA and DoRA merge)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out"),
        (bool(config.get("rank_pattern") or config.get("alpha_pattern")), "per-layer ranks or alphas"),
        (bool(config.get("modules_to_save")), "modules_to_save"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"--adapter {name}: {what} is not supported; train.py's adapters never use it")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / ADAPTER_WEIGHTS)).items():
        match = _ADAPTER_KEY.match(key)
        if match is None:
            raise UserError(f"--adapter {name}: unexpected tensor {key}; only LoRA/DoRA weights of linear layers merge")
        parts.setdefault(match.group(1), {})[match.group(2).split(".")[0]] = tensor
    layers = {}
    for module, found in parts.items():
        if "lora_A" not in found or "lora_B" not in found:
            raise UserError(f"--adapter {name}: {module} lacks lora_A or lora_B; the adapter file is incomplete")
        layers[module] = LoraWeights(found["lora_A"], found["lora_B"], found.get("lora_magnitude_vector"))
    if not layers:
        raise UserError(f"--adapter {name}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return Adapter(path, scaling, layers, target_parameters=list(config.get("target_parameters") or []))


def check_adapter(adapter: Adapter, model: nn.Module, model_name: str) -> None:
    """Refuse an adapter trained on another architecture or other shapes, naming the first layer that differs."""
    modules = dict(model.named_modules())
    _find_expert_adapters(adapter, modules)
    for name, lora in sorted(adapter.experts.items()):
        module_name, _, fused = name.rpartition(".")
        experts, out_features, in_features = _fused_shape(modules[module_name], fused)
        rank = lora.a.shape[0] // experts
        got, expected = (
            [tuple(lora.a.shape), tuple(lora.b.shape)],
            [(rank * experts, in_features), (out_features, rank * experts)],
        )
        if got != expected:
            raise UserError(
                f"--adapter {adapter.path}: {name} is {experts}x{out_features}x{in_features} in --model {model_name} "
                f"but the adapter's shapes {got} do not fit it: it was trained on another base model; pass that one"
            )
    for name, lora in sorted(adapter.layers.items()):
        module = modules.get(name)
        if module is None:
            raise UserError(
                f"--adapter {adapter.path} adapts {name}, which --model {model_name} does not have: it was trained on "
                "another architecture; pass the base model it was trained on"
            )
        out_features, in_features = getattr(module, "out_features", None), getattr(module, "in_features", None)
        rank = lora.a.shape[0]
        expected = [(rank, in_features), (out_features, rank)]
        got = [tuple(lora.a.shape), tuple(lora.b.shape)]
        if lora.magnitude is not None:
            expected, got = [*expected, (out_features,)], [*got, tuple(lora.magnitude.shape)]
        if got != expected:
            raise UserError(
                f"--adapter {adapter.path}: {name} is {out_features}x{in_features} in --model {model_name} but the "
                f"adapter's shapes {got} do not fit it: it was trained on another base model; pass that one"
            )


def _fused_shape(module: nn.Module, fused: str) -> tuple[int, int, int]:
    """(experts, out, in) of a fused projection as PEFT reads it, whether transformers' module or the per-expert
    one holds it (transformers' flagged transposed layout is [experts, in, out]; PEFT reads any other as given)."""
    if isinstance(module, QuantizedExperts):
        return module.peft_shape(fused)
    count, a, b = getattr(module, fused).shape
    return (count, b, a) if experts_flags(module)["is_transposed"] else (count, a, b)


def _find_expert_adapters(adapter: Adapter, modules: dict[str, nn.Module]) -> None:
    """Move the adapter's routed-experts entries from `layers` to `experts`, keyed by fused parameter: PEFT's
    `experts.base_layer.lora_A` adapts an inner wrapper's parameter (see peft_wrapper_depth)."""
    targeted = [t.rpartition(".")[2] for t in adapter.target_parameters]
    for name in list(adapter.layers):
        base, depth = name, 0
        while base.endswith(".base_layer"):
            base, depth = base.removesuffix(".base_layer"), depth + 1
        order = fused_order(modules[base]) if base in modules else []
        found = [n for n in order if n in targeted and peft_wrapper_depth(order, targeted, n) == depth]
        if order and not found:
            raise UserError(f"--adapter {adapter.path}: {name} adapts no parameter its target_parameters name")
        if found:
            adapter.experts[f"{base}.{found[0]}"] = adapter.layers.pop(name)


def merge_experts(weight: torch.Tensor, lora: LoraWeights, scaling: float, *, flagged: bool = False) -> torch.Tensor:
    """A fused projection + scaling x B_e @ A_e for each expert e, in fp32 (PEFT's ParamWrapper delta), transposed
    onto a module transformers flags as transposed ([experts, in, out])."""
    experts = weight.shape[0]
    a = lora.a.float().reshape(experts, -1, lora.a.shape[-1])
    b = lora.b.float().reshape(lora.b.shape[0], -1, experts).permute(2, 0, 1)
    delta = b @ a
    return weight.float() + scaling * (delta.transpose(1, 2) if flagged else delta)


def merge_weight(weight: torch.Tensor, lora: LoraWeights, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in fp32; with DoRA, each output row rescaled to the trained magnitude (PEFT's merge)."""
    merged = weight.float() + scaling * (lora.b.float() @ lora.a.float())
    if lora.magnitude is not None:
        merged = merged * (lora.magnitude.float() / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)
    return merged


def training_backend(quant: QuantConfig, precision: str) -> QuantBackend | None:
    """The backend training builds for these flags (the packed bytes do not depend on the storage dtype)."""
    compute_dtype = quant_compute_dtype(PRECISIONS[precision], quant.compute_dtype)
    return make_backend(quant, storage_dtype=torch.uint8, compute_dtype=compute_dtype)


def check_output(output: str, *, overwrite: bool, inputs: tuple[str, ...]) -> Path:
    """Refuse an --output that is a file, one of the inputs, or (without --overwrite) holds a model already."""
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {output} is a file; choose a directory")
    if any(out.resolve() == Path(p).expanduser().resolve() for p in inputs if p):
        raise UserError(f"--output {output} is one of the inputs; choose a new directory")
    found = [f for f in MODEL_FILES if (out / f).exists()] + [p.name for p in out.glob("*.safetensors")]
    if found and not overwrite:
        raise UserError(
            f"--output {output} already holds a model ({found[0]}); pass --overwrite true to replace it or choose "
            "another --output"
        )
    return out


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh sibling directory, renamed to `out` (replacing it) if the block succeeds, removed if it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp makes it private; a model directory is for anyone to read
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(staging, out)
            shutil.rmtree(old)
        else:
            os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class ShardWriter:
    """Safetensors shards of at most `max_bytes` each, named model-0000i-of-0000N, with their index."""

    def __init__(self, directory: Path, max_bytes: int = SHARD_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        # A host copy of its own: saved tensors must not share memory, and the source is freed with its layer.
        self.pending[name] = tensor.detach().contiguous().to("cpu", copy=True)
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, str(self.directory / f"part-{len(self.files)}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            os.replace(self.directory / f"part-{i}.safetensors", self.directory / final)
            weight_map |= dict.fromkeys(names, final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


@dataclass
class Base:
    """Where the base is quantized, and the check each quantized layer passes before any of it is written."""

    device: torch.device
    verify: Callable[[str, QuantizedLinear], None] | None = None
    threads: int | None = None
    """Intra-op threads to quantize with on the CPU (None: as they are); see Manifest.cpu_threads."""

    def check(self, modules: dict[str, nn.Module]) -> None:
        """Every quantized layer among `modules` (by base-model name) against training's digests, if there are any."""
        for name, module in modules.items():
            if self.verify is not None and isinstance(module, QuantizedLinear):
                self.verify(name, module)


def training_base(skeleton: Skeleton, backend: QuantBackend, *, adapter: str, model_name: str) -> Base:
    """The base as the adapter's manifest describes it (on CPU and unchecked for an adapter without one)."""
    manifest = read_manifest(adapter) if adapter else None
    if manifest is None:
        return Base(torch.device("cpu"))
    verify = manifest.verifier(
        quantized=skeleton.quantized, backend=backend, model_path=skeleton.path, model_name=model_name
    )
    return Base(manifest.device, verify, manifest.cpu_threads)


def _stream_layers(
    skeleton: Skeleton, backend: QuantBackend | None, write: Callable[[dict[str, nn.Module]], None], base: Base
) -> None:
    """Load as training does; `write(modules)` gets each decoder layer as soon as it is whole and its quantized
    layers have passed `base.verify` (then it is freed), and the rest of the model (embeddings, norm, head) once
    everything has been read."""
    names = {id(m): n for n, m in skeleton.model.named_modules()}

    def checked(modules: dict[str, nn.Module]) -> None:
        base.check(modules)
        write(modules)

    def on_unit_ready(name: str, layer: nn.Module) -> None:
        checked({names[id(m)]: m for m in layer.modules()})
        for param in layer.parameters():
            # Emptied in place: the loader still tracks these parameters, and must not allocate them again.
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    with intra_op_threads(base.threads):
        stream_weights(skeleton, backend=backend, device=base.device, on_unit_ready=on_unit_ready)
    in_layers = {id(m) for layer in skeleton.units.values() for m in layer.modules()}
    checked({n: m for n, m in skeleton.model.named_modules() if id(m) not in in_layers})


def _source_names(skeleton: Skeleton) -> dict[tuple[int, str], str]:
    """(id(module), attribute) -> its checkpoint name; tied parameters under every owner."""
    return {(id(module), attr): name for name, (module, attr) in skeleton.sources.items()}


def _save_config(skeleton: Skeleton, out: Path, *, dtype: torch.dtype, quantization: dict[str, Any] | None) -> None:
    """config.json (architecture, dtype, the quantization if any), generation config and tokenizer files."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(skeleton.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if quantization is not None:
        config.quantization_config = quantization
    config.dtype = dtype
    # Loaders pick the class from it (HQQ's requires it); a config without one (converted checkpoints) gets the
    # class the skeleton was built as.
    config.architectures = config.architectures or [type(skeleton.model).__name__]
    config.save_pretrained(str(out))
    try:
        generation = GenerationConfig.from_pretrained(skeleton.path)
    except OSError:  # the base has none: derive it from the model config, as from_pretrained does
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(skeleton.path).save_pretrained(str(out))
    images = load_image_inputs(skeleton.path)
    if images is not None:  # a vision-language model's processor (image processor, chat template) goes along
        images.processor.save_pretrained(str(out))


def merge_adapter(model_cfg: ModelConfig, quant: QuantConfig, *, precision: str, options: MergeConfig) -> Written:
    """Write base + adapter as one plain Hugging Face model directory (see MergeConfig for the choices)."""
    start = time.perf_counter()
    adapter = read_adapter(options.adapter)
    out = check_output(options.output, overwrite=options.overwrite, inputs=(model_cfg.model, options.adapter))
    dequantized = options.base_weights == "dequantized"
    backend = training_backend(quant, precision) if dequantized else None
    if dequantized and backend is None:
        raise UserError("--base_weights dequantized needs the --quant training used (bnb or hqq), not none")
    # The original weights in fp32; dequantized: the other parameters in the dtype training kept them in.
    param_dtype = PRECISIONS[precision].param_dtype if dequantized else torch.float32
    kept = None
    if backend is not None:  # the experts as training held them, kept in the checkpoint's MXFP4 by default
        path = resolve_model_path(model_cfg.model)
        kept = kept_experts_layer(path, quant, storage_dtype=torch.uint8, compute_dtype=backend.compute_dtype)
    skeleton = build_skeleton(model_cfg, backend=backend, param_dtype=param_dtype, kept_experts=kept)
    check_adapter(adapter, skeleton.model, model_cfg.model)
    # The original weights are not quantized, so only a dequantized merge has digests to check.
    base = Base(torch.device("cpu"))
    if backend is not None:
        base = training_base(skeleton, backend, adapter=options.adapter, model_name=model_cfg.model)
    out_dtype = getattr(torch, OUTPUT_DTYPES[options.dtype])
    filled = checkpoint_targets(skeleton)
    source = _source_names(skeleton)

    with _staged(out) as staging:
        writer = ShardWriter(staging)

        def write(modules: dict[str, nn.Module]) -> None:
            tensors: dict[str, torch.Tensor] = {}
            for module_name, module in modules.items():
                if fused_order(module):
                    tensors |= _merged_experts(module_name, module, adapter)
                    continue
                for attr, tensor in module.named_parameters(recurse=False):
                    name = source.get((id(module), attr))
                    if name not in filled:
                        continue
                    if attr == "weight" and isinstance(module, QuantizedLinear):
                        tensor = module.dequantize()
                    if attr == "weight" and module_name in adapter.layers:
                        tensor = merge_weight(tensor.cpu(), adapter.layers[module_name], adapter.scaling)
                    tensors[name] = tensor
            # Written in the checkpoint's own layout (per-expert, as transformers' save_pretrained writes it).
            for name, tensor in revert_weight_conversion(skeleton.model, tensors).items():
                writer.add(name, tensor.to(out_dtype) if tensor.is_floating_point() else tensor)

        _stream_layers(skeleton, backend, write, base)
        writer.close()
        _save_config(skeleton, staging, dtype=out_dtype, quantization=None)
    return Written(out, time.perf_counter() - start, peak_memory_bytes(torch.device("cpu")))


def _merged_experts(module_name: str, module: nn.Module, adapter: Adapter) -> dict[str, torch.Tensor]:
    """A routed-experts module's fused projections (dequantized where quantized) with the adapter merged in."""
    out = {}
    if isinstance(module, QuantizedExperts):
        flagged = module.layout.transposed and not module.layout.peft_reversed
        fused = {name: module.fused(name) for name in module.fused_names()}
    else:
        flagged = experts_flags(module)["is_transposed"]
        fused = {name: param.detach() for name, param in module.named_parameters(recurse=False)}
    for attr, weight in fused.items():
        name = f"{module_name}.{attr}"
        lora = adapter.experts.get(name)
        out[name] = weight if lora is None else merge_experts(weight.cpu(), lora, adapter.scaling, flagged=flagged)
    return out


def _bnb_quantization(backend: QuantBackend, skeleton: Skeleton) -> dict[str, Any]:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=backend.quant_type,  # type: ignore[attr-defined]
        bnb_4bit_use_double_quant=backend.double_quant,  # type: ignore[attr-defined]
        bnb_4bit_compute_dtype=backend.compute_dtype,
        bnb_4bit_quant_storage=torch.uint8,
        llm_int8_skip_modules=[skeleton.head_name] if skeleton.head_name else None,
    ).to_dict()


def _export_bnb(skeleton: Skeleton, backend: QuantBackend, staging: Path, param_dtype: torch.dtype, base: Base) -> None:
    """Safetensors shards in transformers' pre-quantized 4-bit layout, with the quantization in config.json."""
    writer = ShardWriter(staging)
    in_checkpoint = checkpoint_targets(skeleton)
    source = _source_names(skeleton)

    def write(modules: dict[str, nn.Module]) -> None:
        for module_name, module in modules.items():
            if isinstance(module, QuantizedLinear):
                for key, tensor in module.serialized().items():
                    writer.add(f"{module_name}.{key}", tensor)
                continue
            for attr, tensor in module.named_parameters(recurse=False):
                if source.get((id(module), attr)) in in_checkpoint:
                    writer.add(source[(id(module), attr)], tensor.to(param_dtype))

    _stream_layers(skeleton, backend, write, base)
    writer.close()
    _save_config(skeleton, staging, dtype=param_dtype, quantization=_bnb_quantization(backend, skeleton))


def _export_hqq(skeleton: Skeleton, backend: QuantBackend, staging: Path, param_dtype: torch.dtype, base: Base) -> None:
    """HQQ's own format: qmodel.pt, {module name: its state dict} (HQQ's layout for quantized layers), and
    config.json, which `AutoHQQHFModel.from_quantized` reads. One file, as HQQ's loader wants: it holds the whole
    quantized model, so this is the one output not written shard by shard."""
    weights: dict[str, dict[str, Any]] = {}

    def write(modules: dict[str, nn.Module]) -> None:
        for module_name, module in modules.items():
            if isinstance(module, QuantizedLinear):
                weights[module_name] = {k: _own(v) for k, v in module.serialized().items()}
            elif list(module.parameters(recurse=False)) and not list(module.children()):
                # Tied parameters under every owner: HQQ's loader fills each module from its own entry.
                weights[module_name] = {a: _own(t.to(param_dtype)) for a, t in module.named_parameters(recurse=False)}

    _stream_layers(skeleton, backend, write, base)
    torch.save(weights, staging / HQQ_WEIGHTS)
    _save_config(skeleton, staging, dtype=param_dtype, quantization=None)


def _own(value: Any) -> Any:
    """A tensor copied to the host out of the layer (which is freed next); other metadata as is."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _check_hqq_shapes(skeleton: Skeleton, backend: QuantBackend) -> None:
    for name in skeleton.quantized:
        layer = skeleton.model.get_submodule(name)
        numel = layer.in_features * layer.out_features
        if backend.padded(numel) != numel:  # type: ignore[attr-defined]
            raise UserError(
                f"--quant hqq: {name} ({layer.out_features}x{layer.in_features}) does not split into whole groups of "
                f"--hqq_group_size {backend.group_size}, and HQQ's format cannot hold the padding training added; "  # type: ignore[attr-defined]
                "merge the adapter with scripts/merge_adapter.py --base_weights dequantized instead"
            )


EXPORTERS: dict[str, Callable[[Skeleton, QuantBackend, Path, torch.dtype, Base], None]] = {
    "bnb": _export_bnb,
    "hqq": _export_hqq,
}
CHECKS: dict[str, Callable[[Skeleton, QuantBackend], None]] = {"hqq": _check_hqq_shapes}


def export_quantized(model_cfg: ModelConfig, quant: QuantConfig, *, precision: str, options: ExportConfig) -> Written:
    """Write the base model quantized as training quantized it, in the backend library's own format."""
    start = time.perf_counter()
    resolve_model_path(model_cfg.model)
    out = check_output(options.output, overwrite=options.overwrite, inputs=(model_cfg.model, options.adapter))
    if options.adapter and read_manifest(options.adapter) is None:
        raise UserError(
            f"--adapter {options.adapter}: no {MANIFEST_FILE} (train.py writes one beside every adapter it saves); "
            "pass the training run's quantization flags instead of --adapter"
        )
    backend = training_backend(quant, precision)
    if backend is None:
        raise UserError("--quant none has nothing to export; pass the --quant training used (bnb or hqq)")
    param_dtype = PRECISIONS[precision].param_dtype
    skeleton = build_skeleton(model_cfg, backend=backend, param_dtype=param_dtype)
    experts = next((m for m in skeleton.model.modules() if isinstance(m, QuantizedExperts)), None)
    if experts is not None:
        raise UserError(
            f"--model {model_cfg.model} has routed experts, which no {backend.library} loader reads quantized "
            "(transformers quantizes only linear layers); merge the adapter instead (scripts/merge_adapter.py)"
        )
    if backend.name in CHECKS:
        CHECKS[backend.name](skeleton, backend)
    base = training_base(skeleton, backend, adapter=options.adapter, model_name=model_cfg.model)
    with _staged(out) as staging:
        EXPORTERS[backend.name](skeleton, backend, staging, param_dtype, base)
    return Written(out, time.perf_counter() - start, peak_memory_bytes(torch.device("cpu")))
