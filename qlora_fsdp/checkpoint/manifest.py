"""The manifest training writes beside its adapter, so the after-training scripts rebuild the very base it learned on.

`qlora_manifest.json` (MANIFEST_FILE) records the flags that decide the quantized bytes, the model, where and with
which library versions the base was quantized, and a digest of every quantized layer's packed bytes and state, by
module name as in the base model. Training computes the digests at load time, on rank 0, while each decoder layer is
still whole (before sharding: no gather). merge_adapter.py, export_quantized.py and generate.py take their flags
from it and check each layer they quantize against its digests before writing (or answering) anything.

A digest covers `packed_bytes()` and every `state_tensors()` value (name, dtype, shape and bytes), read back on
the CPU: the same bytes give the same digest whatever layout the layer stores them in and whatever device holds them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig, TrainConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.hub import model_identity
from qlora_fsdp.quant import QuantBackend
from qlora_fsdp.quant.base import QuantizedLinear

MANIFEST_FILE = "qlora_manifest.json"
"""What train.py writes beside the adapter: the flags of `manifest_flags`, with digests of the base."""
FORMAT = 1
"""Bumped when a field changes meaning; a reader refuses formats it does not know."""
_CHUNK = 1 << 24
"""Bytes copied to the host at a time while hashing: bounds the extra memory a digest of a large layer takes."""


def manifest_flags(quant: str) -> tuple[str, ...]:
    """The flags that decide the quantized bytes, which the manifest records: --quant, the backend's own
    --QUANT_* flags, --compute_dtype and --precision (which decides what compute dtype auto means)."""
    own = tuple(f.name for f in fields(QuantConfig) if f.name.startswith(f"{quant}_"))
    return ("quant", *own, "compute_dtype", "precision")


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes, read on the CPU a chunk at a time (128 bits, hex)."""
    tensor = tensor.detach()
    digest = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _CHUNK):
        # A copy of its own: a numpy view of a parameter would make its storage unresizable, which FSDP2 needs.
        digest.update(flat[start : start + _CHUNK].to("cpu", copy=True).numpy())
    return digest.hexdigest()[:32]


def layer_digests(module: QuantizedLinear) -> dict[str, str]:
    """{"packed": digest of the packed bytes, state name: digest of that state tensor} of one quantized layer."""
    state = module.state_tensors()
    return {"packed": tensor_digest(module.packed_bytes()), **{k: tensor_digest(v) for k, v in state.items()}}


class LayerDigests:
    """Digests of a model's quantized layers as loading fills them, under their names in the base model.

    Built on the skeleton before adapters are injected (PEFT renames a wrapped layer `....base_layer` but keeps the
    module), so the names are those the after-training scripts, which load no adapters, see.
    """

    def __init__(self, model: nn.Module, quantized: list[str]) -> None:
        self._names = {id(model.get_submodule(name)): name for name in quantized}
        self.layers: dict[str, dict[str, str]] = {}

    def add(self, module: nn.Module) -> None:
        """Digest every loaded quantized layer inside `module` not digested yet."""
        for sub in module.modules():
            name = self._names.get(id(sub))
            if name is not None and name not in self.layers and isinstance(sub, QuantizedLinear) and not sub.is_meta:
                self.layers[name] = layer_digests(sub)


def environment(*, device: torch.device, backend: QuantBackend | None, threads: int | None = None) -> dict[str, str]:
    """Where and with what the base is quantized: the device type (and on the CPU the intra-op threads, `threads`
    or torch's current count), the compute dtype and the library versions."""
    out = {"device": device.type, "torch": torch.__version__, "transformers": metadata.version("transformers")}
    if device.type == "cpu":
        out["cpu_threads"] = str(threads or torch.get_num_threads())
    if backend is not None:
        out["compute_dtype"] = str(backend.compute_dtype).removeprefix("torch.")
        out[backend.library] = metadata.version(backend.library)
    return out


@dataclass
class Manifest:
    """What qlora_manifest.json holds (see the module docstring)."""

    flags: dict[str, Any]
    """The build flags training ran with that decide the base's bytes (config.manifest_flags)."""
    model: str
    """--model as training was given it."""
    model_identity: str
    """checkpoint.model_identity of the base model directory: tells a different base from a renamed copy."""
    quantized_with: dict[str, str]
    """environment() of training's quantization: device (CPU threads), compute dtype, torch, transformers and the
    backend library's versions."""
    layers: dict[str, dict[str, str]]
    """Quantized module name (as in the base model) -> layer_digests()."""
    format: int = FORMAT

    def write(self, directory: Path) -> None:
        (directory / MANIFEST_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @property
    def cpu_threads(self) -> int | None:
        """The intra-op threads to quantize with on the CPU: training's count, since HQQ's optimizer on the CPU gives
        other bytes with one thread than with several (torchrun starts each rank with one). None: as it is."""
        recorded = self.quantized_with.get("cpu_threads")
        return int(recorded) if recorded and self.device.type == "cpu" else None

    @property
    def device(self) -> torch.device:
        """Where the after-training scripts quantize: on CUDA if training did and a GPU is visible, else the CPU."""
        cuda = self.quantized_with.get("device") == "cuda" and torch.cuda.is_available()
        return torch.device("cuda" if cuda else "cpu")

    def verifier(
        self, *, quantized: list[str], backend: QuantBackend, model_path: Path, model_name: str
    ) -> Callable[[str, QuantizedLinear], None]:
        """Check now that the model quantizes the layers training did; returns the check each of them must pass
        once `backend` has quantized it on `self.device` (raises DigestMismatch)."""
        self.check_layer_names(quantized, model_name=model_name)
        here = environment(device=self.device, backend=backend, threads=self.cpu_threads)
        return functools.partial(self.check_layer, here=here, identity=model_identity(model_path))

    def check_layer_names(self, quantized: list[str], *, model_name: str) -> None:
        """Refuse a model that quantizes other layers than training did, before anything is quantized."""
        mine, theirs = set(quantized), set(self.layers)
        if mine != theirs:
            name = sorted(mine ^ theirs)[0]
            where = "only this --model" if name in mine else "only the adapter's base"
            raise UserError(
                f"--model {model_name} does not quantize the layers the adapter's manifest lists ({name}: {where} has "
                "it): the adapter was trained on another base model; pass that one"
            )

    def check_layer(self, name: str, module: QuantizedLinear, *, here: dict[str, str], identity: str) -> None:
        """Raise DigestMismatch, naming the likely cause and its fix, if `module` holds other bytes than training.

        `here` is this run's environment(), `identity` the model_identity of the --model it quantized.
        """
        seen = layer_digests(module)
        expected = self.layers[name]
        differ = [part for part in sorted(seen.keys() | expected.keys()) if seen.get(part) != expected.get(part)]
        if not differ:
            return
        causes = []
        # Not the threads: the scripts quantize with training's count (cpu_threads) wherever it applies.
        for key in sorted((self.quantized_with.keys() | here.keys()) - {"cpu_threads"}):
            was, now = self.quantized_with.get(key, "none"), here.get(key, "none")
            if was != now:
                causes.append(_CAUSES.get(key, _VERSION).format(key=key, was=was, now=now))
        if not causes and identity != self.model_identity:
            causes.append("--model's files are not the ones training read: pass the base model it was trained on")
        if not causes:
            causes.append(
                "same device, dtype and versions as training: the base model's weights or the manifest changed "
                f"since; pass the base model training used or restore {MANIFEST_FILE} from the training run"
            )
        raise DigestMismatch(
            f"{name} quantizes to other bytes than training used ({', '.join(differ)} differ), so the adapter "
            f"would run on another base than it learned against: {'; '.join(causes)}"
        )


def training_manifest(
    cfg: TrainConfig, *, model_path: Path, device: torch.device, backend: QuantBackend | None, digests: LayerDigests
) -> Manifest:
    """The manifest of a training run whose base `backend` quantized on `device` (digests taken as it loaded)."""
    flags = cfg.to_dict()
    return Manifest(
        flags={flag: flags[flag] for flag in manifest_flags(cfg.quant.quant)},
        model=cfg.model.model,
        model_identity=model_identity(model_path),
        quantized_with=environment(device=device, backend=backend),
        layers=digests.layers,
    )


_CAUSES = {
    "device": "training quantized on {was}, this run on {now}: run this where a {was} device is visible",
    "compute_dtype": (
        "training quantized in {was}, this run in {now}: the manifest's flags do not give the dtype its digests "
        "were made in; restore " + MANIFEST_FILE + " from the training run"
    ),
}
_VERSION = "training used {key} {was}, this run {key} {now}: install {key}=={was}"


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside (None: left as it is)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DigestMismatch(UserError):
    """A layer quantized by an after-training script differs from the bytes training used."""


def read_manifest(directory: str | Path) -> Manifest | None:
    """The manifest in an adapter (or checkpoint) directory; None where training wrote none (older adapters)."""
    path = Path(directory).expanduser() / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(Manifest)}
        if raw.get("format") != FORMAT or known != set(raw) or not isinstance(raw["flags"], dict):
            raise ValueError
        return Manifest(**raw)
    except (ValueError, AttributeError):
        raise UserError(
            f"{path} is not a manifest this version reads (format {FORMAT}); restore it from the training run or "
            "delete it and pass the training run's quantization flags"
        ) from None
