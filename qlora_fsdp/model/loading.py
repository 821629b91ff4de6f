"""Model loading: skeleton on meta, stream safetensors shards one tensor at a time, quantize each linear as it
arrives, and hand each decoder layer on (to be sharded) as soon as it is whole.

Every rank reads the checkpoint itself; none holds more than its shards plus the layers in flight and the
embeddings, head and norm (sharded last, with the root). There is no rank-0 copy of the model; the only thing sent
between ranks is quantized results, which the ranks share out instead of each computing them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from qlora_fsdp.compat import no_split_modules
from qlora_fsdp.config.options import ModelConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.attention import fix_latent_attention
from qlora_fsdp.model.conversion import CheckpointNames
from qlora_fsdp.model.vision import auto_model_class, vision_parts
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.quant import QuantBackend
from qlora_fsdp.quant.base import QuantizedLinear, QuantizedWeight
from qlora_fsdp.quant.experts import FUSED, QuantizedExperts, replace_experts, router_gates

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_FILE = "pytorch_model.bin"


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") != 1 or (os.sep == "\\" and "\\" in name)


def resolve_model_path(name: str) -> Path:
    """A local directory as is; a hub id downloaded (config, tokenizer and safetensors only) to the HF cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {name}: directory has no config.json; point --model at a Hugging Face model dir")
        return path
    if path.exists() or _looks_like_path(name):
        raise UserError(f"--model {name}: no such model directory; pass a local model directory or a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as exc:  # offline, unknown repo, gated: the same advice for each
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"--model {name}: not a local directory and the Hugging Face hub could not provide it ({reason}); "
            "download it beforehand and pass the local directory"
        ) from None


def shard_files(path: Path, *, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a model directory in index order; every listed shard must exist.

    safetensors only, unless `allow_pickle`: a pickle (.bin) checkpoint can run code when loaded.
    """
    for index_name, single, pickled in ((INDEX_FILE, SINGLE_FILE, False), (PICKLE_INDEX, PICKLE_FILE, True)):
        index = path / index_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / single).is_file():
            files = [single]
        else:
            continue
        if pickled and not allow_pickle:
            raise UserError(
                f"--model {path}: only pickle weights ({files[0]}), which can run code when loaded; convert them to "
                "safetensors or pass --allow_pickle true (they are then loaded with torch.load(weights_only=True))"
            )
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise UserError(f"--model {path}: shard {missing[0]} is listed in {index_name} but missing; re-download it")
        return [path / f for f in files]
    raise UserError(f"--model {path}: no {INDEX_FILE} or {SINGLE_FILE}; the model directory has no weights")


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def safetensors_header(file: Path) -> tuple[int, dict[str, dict]]:
    """(header length, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file, without its metadata."""
    file_size = file.stat().st_size
    with open(file, "rb", buffering=0) as fh:
        size = int.from_bytes(fh.read(8), "little")
        try:
            if not 0 < size <= file_size - 8:
                raise ValueError
            header = json.loads(fh.read(size))
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"--model: {file} is not a safetensors file (unreadable header); re-download it") from None
    header.pop("__metadata__", None)
    return size, header


def read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order, each read into fresh memory.

    Not through safetensors' memory map: every page of a mapped shard that is touched stays in this process's
    resident set until the file is closed, which would put a whole shard into each rank's peak. Plain reads go
    through the page cache, which is the machine's, not the process's.
    """
    file_size = file.stat().st_size
    size, header = safetensors_header(file)
    with open(file, "rb", buffering=0) as fh:
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise UserError(f"--model: {file} stores {name} as {info['dtype']}, which this loader cannot read")
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=dtype)
            # The bytes are read straight into the tensor: they must be exactly its size and inside the file.
            if not 0 <= begin <= end <= file_size - 8 - size or end - begin != tensor.numel() * tensor.element_size():
                raise UserError(f"--model: {file} has a corrupt header ({name}'s offsets do not fit); re-download it")
            fh.seek(8 + size + begin)
            # Read straight into the tensor's memory (a numpy view would make its storage unresizable for FSDP2),
            # in several reads where one read(2) returns less (Linux stops at 2 GiB).
            view = memoryview((ctypes.c_char * (end - begin)).from_address(tensor.data_ptr())).cast("B")
            done = 0
            while done < end - begin:
                got = fh.readinto(view[done:])
                if not got:
                    raise UserError(f"--model: {file} is truncated (ends inside {name}); re-download it")
                done += got
            yield name, tensor


def _tensor_names(file: Path) -> list[str]:
    """The names a weight file holds, without reading its tensors (a pickle's come from its memory-mapped index)."""
    if file.suffix == ".safetensors":
        return list(safetensors_header(file)[1])
    return list(torch.load(file, map_location="meta", weights_only=True, mmap=True))


def _read_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time: safetensors from disk; pickle only with weights_only, memory-mapped."""
    if file.suffix == ".safetensors":
        yield from read_safetensors(file)
    else:
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create parameters on meta but buffers (RoPE inv_freq) for real: buffers are computed, not loaded."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def meta_model(path: Path, *, dtype: torch.dtype, trust_remote_code: bool, attention: str = "sdpa") -> nn.Module:
    """The architecture from config.json with every parameter on meta (no memory, no init cost), attending with
    the `attention` implementation of transformers (sdpa; flash_attention_2 for packed rows where it runs)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise UserError(
            f"--model {path}: config.json is not a known architecture ({str(exc).splitlines()[0]})"
        ) from None
    config.use_cache = False
    auto_class = auto_model_class(config, where=str(path))
    with _params_on_meta():
        try:
            model = auto_class.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attention
            )
        except ValueError as exc:
            if attention == "eager" or "attention implementation" not in str(exc):
                raise
            # An architecture without sdpa (GPT-OSS, say) attends as transformers itself would load it: eagerly.
            log.warning("--model %s: %s attention is not supported by this architecture; using eager", path, attention)
            model = auto_class.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="eager"
            )
    fix_latent_attention(model)
    if getattr(config, "tie_word_embeddings", False):
        # Tying inside _params_on_meta made two meta copies; one parameter with two owners, filled once.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def decoder_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated block classes named by the model's `_no_split_modules` (not hard-coded to Llama)."""
    names = set(no_split_modules(model))
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise UserError(
            f"--model: architecture {type(model).__name__} declares no decoder layer class (_no_split_modules) "
            "that FSDP can wrap; use a causal LM from transformers such as Llama, Mistral or Qwen2"
        )
    return tuple(sorted(classes, key=lambda c: c.__name__))


def expanded_layer_prefixes(path: Path) -> tuple[str, ...]:
    """Module-name prefixes of the blocks scripts/block_expansion.py added (config.json `llama_pro_new_layers`)."""
    config = json.loads((path / "config.json").read_text())
    indices = config.get("llama_pro_new_layers")
    if not indices:
        raise UserError(
            f"--train_type llama_pro: {path} has no expanded blocks; run scripts/block_expansion.py --model {path} "
            "--output DIR and train DIR"
        )
    return tuple(f"model.layers.{i}." for i in indices)


@dataclass
class Skeleton:
    """The model on the meta device, its linears already swapped for quantized ones, and where weights go."""

    model: nn.Module
    path: Path
    files: list[Path]
    layer_classes: tuple[type[nn.Module], ...]
    """Decoder layer classes: the FSDP wrapping and checkpointing unit, found from `_no_split_modules`."""
    units: dict[str, nn.Module]
    """Decoder layers by qualified name, in model order: each is filled, then handed on, as soon as it is whole."""
    quantized: list[str]
    """Qualified names of the linears the backend replaced."""
    head_name: str | None
    """Qualified name of the output head (never quantized)."""
    sources: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """Checkpoint tensor name -> (module, attribute) it fills, named before adapters rename anything."""


def build_skeleton(
    cfg: ModelConfig,
    *,
    backend: QuantBackend | None,
    param_dtype: torch.dtype,
    path: Path | None = None,
    full_precision_prefixes: tuple[str, ...] = (),
    attention: str = "sdpa",
    adapt_experts: bool = False,
) -> Skeleton:
    """The architecture from config.json on meta, with every linear but the head (and `full_precision_prefixes`)
    replaced by the backend's empty quantized layer. Nothing is read from the checkpoint yet."""
    path = path or resolve_model_path(cfg.model)
    files = shard_files(path, allow_pickle=cfg.allow_pickle)
    model = meta_model(path, dtype=param_dtype, trust_remote_code=cfg.trust_remote_code, attention=attention)
    layer_classes = decoder_layer_classes(model)
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    parts = vision_parts(model)
    if parts is not None:  # an image-text model's vision tower and projector stay in full precision by default
        full_precision_prefixes += parts.unquantized(quantize_vision=cfg.quantize_vision)
    if backend is not None:
        # The output head stays in full precision: small next to the body and sensitive to quantization error; so
        # do the gates that route tokens.
        gates = router_gates(model)
        backend.replace_linears(
            model,
            should_quantize=lambda n: n != head_name and not n.startswith(full_precision_prefixes) and n not in gates,
        )
    if backend is not None or adapt_experts:
        # Routed experts become one layer per expert: quantized like the linears or, unquantized with adapters on
        # them, plain frozen linears. Full fine-tuning without quantization trains transformers' own fused module.
        replace_experts(model, backend.make_module if backend is not None else _plain_linear)
    quantized = [n for n, m in model.named_modules() if backend is not None and backend.is_quantized(m)]
    # Quantized layers keep the checkpoint's names (weight, bias): their `weight` quantizes what arrives.
    sources = {n: _owner(model, n) for n, _ in model.named_parameters(remove_duplicate=False)}
    sources |= {n: _owner(model, n) for n, _ in model.named_buffers()}
    units = {n: m for n, m in model.named_modules() if isinstance(m, layer_classes)}
    return Skeleton(model, path, files, layer_classes, units, quantized, head_name, sources)


def _plain_linear(linear: nn.Linear) -> nn.Linear:
    return linear


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


class _Params:
    """Every (module, attribute) that holds each parameter, so replacing a tied parameter replaces it everywhere."""

    def __init__(self, model: nn.Module) -> None:
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    self.holders.setdefault(id(param), []).append((module, attr))

    def replace(self, old: nn.Parameter, value: torch.Tensor) -> None:
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        holders = self.holders.pop(id(old))
        for module, attr in holders:
            module._parameters[attr] = new
        self.holders[id(new)] = holders

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Allocate every parameter of `module` still on meta (adapters: initialised later) and move buffers."""
        for param in list(module.parameters()):
            if param.is_meta:
                self.replace(param, torch.empty_like(param, device=device))
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta:
                    sub._buffers[name] = buf.to(device)


def stream_weights(
    skeleton: Skeleton,
    *,
    backend: QuantBackend | None,
    device: torch.device,
    on_unit_ready: Callable[[str, nn.Module], None] | None = None,
    env: DistEnv | None = None,
) -> None:
    """Read the checkpoint one tensor at a time into the skeleton, quantizing each target weight as it arrives.

    With `env`, every rank of the job streams the same checkpoint and shares the quantization out: the backend
    splits each weight between the ranks (see QuantBackend.quantize), or, for a backend that needs weights whole
    (`whole_weights`), each rank quantizes whole weights of a decoder layer and the layer's results are exchanged
    when it is complete (_WeightShares). Without `env` this process quantizes every weight itself.

    Tensors may come in any order and a decoder layer may span shards: as soon as every tensor of a layer has
    arrived, its remaining meta parameters (adapters) are allocated and `on_unit_ready(name, layer)` runs, so the
    caller can shard it and free the full copy. Parameters outside decoder layers (embeddings, norm, head) are
    kept whole; the caller handles them after this returns. Raises UserError naming a missing tensor.
    """
    model = skeleton.model
    params = _Params(model)
    quantized = {id(m) for n, m in model.named_modules() if backend is not None and backend.is_quantized(m)}
    by_length = sorted(skeleton.units, key=len, reverse=True)

    def unit_of(name: str) -> str:
        return next((u for u in by_length if name.startswith(u + ".")), "")

    # A required "slot" is one parameter; tied names (embed_tokens / lm_head) share one slot.
    slot_of = {name: id(m._parameters[attr]) for name, (m, attr) in skeleton.sources.items() if attr in m._parameters}
    pending: dict[str, set[int]] = {}
    for name, slot in slot_of.items():
        pending.setdefault(unit_of(name), set()).add(slot)
    first_name = {}
    for name, slot in slot_of.items():
        first_name.setdefault(slot, name)
    shares = None
    if backend is not None and backend.whole_weights and env is not None and env.world_size > 1:
        by_unit: dict[str, list[QuantizedLinear]] = {}
        for name, (module, attr) in skeleton.sources.items():
            if id(module) in quantized and attr == "weight" and unit_of(name):
                by_unit.setdefault(unit_of(name), []).append(module)  # type: ignore[arg-type]
        shares = _WeightShares(by_unit, backend=backend, env=env, device=device)

    # Where every tensor goes is known from the files' names: a checkpoint that cannot fill the model is refused
    # before any weight is read.
    experts = _split_experts(skeleton)
    names = _checkpoint_names(skeleton, experts)
    filled = {slot_of[n] for target in names.targets() for n in _expand(target, experts) if n in slot_of}
    missing = sorted(first_name[s] for slots in pending.values() for s in slots if s not in filled)
    if missing:
        raise UserError(
            f"--model {skeleton.path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}; is it complete?"
        )
    short = names.incomplete(lambda target: _expert_count(model, target))
    if short:
        raise UserError(f"--model {skeleton.path}: checkpoint lacks expert tensors ({short[0]}); is it complete?")

    def place(name: str, tensor: torch.Tensor) -> None:
        source = skeleton.sources.get(name)
        if source is None:
            log.warning("ignoring checkpoint tensor %s: no such parameter in the model", name)
            return
        module, attr = source
        if id(module) in quantized and attr == "weight":  # a bias of a quantized layer is a plain parameter
            if shares is not None and shares.covers(module):
                shares.arrive(module, tensor)  # type: ignore[arg-type]
            else:
                backend.load_weight(module, tensor, device=device, env=env)  # type: ignore[union-attr]
        elif attr in module._parameters:
            old = module._parameters[attr]
            params.replace(old, tensor.to(device=device, dtype=old.dtype if tensor.is_floating_point() else None))
        else:
            module._buffers[attr] = tensor.to(device)
            return
        unit = unit_of(name)
        waiting = pending.get(unit)
        if waiting is None:
            return
        waiting.discard(slot_of[name])
        if not waiting and unit:
            del pending[unit]
            if shares is not None:
                shares.exchange(unit)
            layer = skeleton.units[unit]
            params.materialize(layer, device)
            if on_unit_ready is not None:
                on_unit_ready(unit, layer)

    for file in skeleton.files:
        for checkpoint_name, tensor in _read_tensors(file):
            for name, converted in names.arrive(checkpoint_name, tensor).items():
                parts = _expand(name, experts)
                if parts == [name]:
                    place(name, converted)
                else:  # a fused experts tensor: one 2-D weight per expert
                    for part, weight in zip(parts, converted.unbind(0), strict=True):
                        place(part, weight)
    params.materialize(model, device)


def checkpoint_targets(skeleton: Skeleton) -> set[str]:
    """The model names the checkpoint fills, after transformers' conversion (fused experts by their fused name)."""
    return _checkpoint_names(skeleton, _split_experts(skeleton)).targets()


def _checkpoint_names(skeleton: Skeleton, experts: dict[str, QuantizedExperts]) -> CheckpointNames:
    names = [n for file in skeleton.files for n in _tensor_names(file)]
    return CheckpointNames(skeleton.model, names, _model_names(skeleton, experts))


def _expert_count(model: nn.Module, target: str) -> int | None:
    """How many experts the module holding `target` has (None: not an experts module)."""
    with contextlib.suppress(AttributeError):
        return getattr(model.get_submodule(target.rpartition(".")[0]), "num_experts", None)
    return None


def _split_experts(skeleton: Skeleton) -> dict[str, QuantizedExperts]:
    return {n: m for n, m in skeleton.model.named_modules() if isinstance(m, QuantizedExperts)}


def _model_names(skeleton: Skeleton, experts: dict[str, QuantizedExperts]) -> list[str]:
    """The model's tensor names as transformers knows them: routed experts split here keep their fused names."""
    inside = tuple(f"{n}." for n in experts)
    names = [n for n in skeleton.sources if not (inside and n.startswith(inside))]
    return names + [f"{n}.{fused}" for n in experts for fused in FUSED]


def _expand(name: str, experts: dict[str, QuantizedExperts]) -> list[str]:
    """`name` itself, or for a fused experts name (`...experts.gate_up_proj`) the per-expert weights it fills."""
    module_name, _, attr = name.rpartition(".")
    if module_name not in experts or attr not in FUSED:
        return [name]
    return [f"{module_name}.{FUSED[attr]}.{i}.weight" for i in range(experts[module_name].num_experts)]


class _WeightShares:
    """Which rank quantizes which whole weight of each decoder layer, for a backend that needs weights whole (HQQ).

    A rank quantizes the weights it owns as they arrive and drops the others; when a layer is complete, each
    owner broadcasts its results, so every rank ends with the bytes one process quantizing everything produces.
    Owners are fixed up front from the skeleton's shapes, the same on every rank without communication: largest
    weight first, each to the rank with the least work so far (carried across layers), so the ranks finish a
    layer's shares at about the same time.
    """

    def __init__(
        self,
        by_unit: dict[str, list[QuantizedLinear]],
        *,
        backend: QuantBackend,
        env: DistEnv,
        device: torch.device,
    ) -> None:
        self.by_unit = by_unit
        self.backend = backend
        self.env = env
        self.device = device
        self.owner: dict[int, int] = {}
        self.results: dict[int, QuantizedWeight] = {}
        work = [0] * env.world_size
        for modules in by_unit.values():
            for module in sorted(modules, key=lambda m: -m.in_features * m.out_features):
                rank = min(range(env.world_size), key=lambda r: (work[r], r))
                self.owner[id(module)] = rank
                work[rank] += module.in_features * module.out_features

    def covers(self, module: nn.Module) -> bool:
        return id(module) in self.owner

    def arrive(self, module: QuantizedLinear, weight: torch.Tensor) -> None:
        """Quantize `weight` now if this rank owns it; another rank's is dropped, its result comes in exchange."""
        if self.owner[id(module)] == self.env.rank:
            self.results[id(module)] = self.backend.quantize(weight.to(self.device))

    def exchange(self, unit: str) -> None:
        """Every weight of a complete `unit` into its layer on every rank, each sent from its owner.

        One object collective carries the layer's small metadata (scalar meta, dtypes and shapes); each weight's
        bytes then go in one broadcast of a flat uint8 tensor on the weights' device (gloo or NCCL alike).
        """
        modules = self.by_unit.pop(unit, [])
        if not modules:
            return
        mine = {i: self.results.pop(id(m)) for i, m in enumerate(modules) if self.owner[id(m)] == self.env.rank}
        layouts: list[dict[int, tuple]] = [{} for _ in range(self.env.world_size)]
        dist.all_gather_object(layouts, {i: _layout(q) for i, q in mine.items()})
        for i, module in enumerate(modules):
            owner = self.owner[id(module)]
            module.set_quantized(_broadcast(mine.get(i), layouts[owner][i], src=owner, device=self.device))


def _layout(quantized: QuantizedWeight) -> tuple[int, list[tuple[str, torch.dtype, torch.Size]], dict]:
    """What a receiver needs to rebuild `quantized` from its bytes: packed size, state dtypes and shapes, meta."""
    states = [(name, t.dtype, t.shape) for name, t in quantized.state.items()]
    return quantized.packed.numel(), states, quantized.meta


def _broadcast(quantized: QuantizedWeight | None, layout: tuple, *, src: int, device: torch.device) -> QuantizedWeight:
    """Rank `src`'s `quantized` on every rank (None elsewhere): packed bytes and state sent as one flat buffer."""
    packed_numel, states, meta = layout
    sizes = [packed_numel, *(shape.numel() * dtype.itemsize for _, dtype, shape in states)]
    if quantized is not None:
        state_bytes = [t.contiguous().flatten().view(torch.uint8) for t in quantized.state.values()]
        dist.broadcast(torch.cat([quantized.packed.flatten(), *state_bytes]), src=src)
        return quantized
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    packed, *parts = buffer.split(sizes)
    state = {name: t.clone().view(dtype).view(shape) for (name, dtype, shape), t in zip(states, parts, strict=True)}
    return QuantizedWeight(packed.clone(), state, meta)


def load_model(
    cfg: ModelConfig,
    *,
    backend: QuantBackend | None,
    device: torch.device,
    param_dtype: torch.dtype,
    path: Path | None = None,
) -> Skeleton:
    """The whole model in this process, quantized, unsharded (tools and tests; training streams into shards)."""
    skeleton = build_skeleton(cfg, backend=backend, param_dtype=param_dtype, path=path)
    stream_weights(skeleton, backend=backend, device=device)
    return skeleton


def load_tokenizer(path: Path):
    """The model's tokenizer; one without a pad token pads with eos (labels mask the padding anyway)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_identity(path: Path) -> str:
    """A short digest of a model directory's config.json and the start of each weight file.

    It tells another base model (even one with the same architecture) from this one, whatever the directory is
    called now, without reading the weights.
    """
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        with open(file, "rb") as fh:
            digest.update(fh.read(1 << 16))
        digest.update(str(file.stat().st_size).encode())
    return f"config and weights {digest.hexdigest()[:16]}"


FLASH_ATTENTION = "flash_attention_2"


def attention_implementation(*, packing: bool, device: torch.device, dtype: torch.dtype) -> str:
    """flash_attention_2 for packed rows on a GPU where flash-attn is installed (it needs bf16/fp16), else sdpa."""
    if not packing or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    return FLASH_ATTENTION if is_flash_attn_2_available() else "sdpa"
