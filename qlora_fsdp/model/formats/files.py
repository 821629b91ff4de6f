"""Reading a weight file's tensors one at a time, or just the rows of one a rank needs: safetensors into fresh
memory, pickle only with weights_only.

Every checkpoint format (qlora_fsdp/model/formats/) reads its files through here, as references (Lazy) that read
when asked; what it makes of the tensors is its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import torch

from qlora_fsdp.errors import UserError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
"""What a plain checkpoint may store; a quantized format reads more (FP8_DTYPES) and says what they mean."""
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}


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


class LoadCounters:
    """What this process has done loading, for the load's report (each rank its share shows here): bytes read from
    weight files (tensor data; headers and indexes aside) and seconds spent dequantizing and quantizing."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.seconds = {"dequantize": 0.0, "quantize": 0.0}

    def reset(self) -> None:
        self.bytes_read = 0
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Count the time inside under `kind` ("dequantize" or "quantize")."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - start


LOAD = LoadCounters()


class Lazy(ABC):
    """A checkpoint tensor's values, not read yet: read whole, or a run of its first dimension (rows of a weight,
    experts of a fused one), so that a rank can read just the part it works on."""

    shape: torch.Size
    dtype: torch.dtype

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @abstractmethod
    def read(self) -> torch.Tensor:
        """The whole tensor, in fresh memory of its own."""

    @abstractmethod
    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """`[start:stop]` along the first dimension, reading only those bytes where the storage allows it."""

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        """Values `[start:stop]` of the tensor flattened (a run of a weight's blocks), reading the rows holding them."""
        row = self.shape[1:].numel()
        first, last = start // row, -(-stop // row)
        return self.read_rows(first, last).flatten()[start - first * row : stop - first * row]


class TensorRef(Lazy):
    """A tensor stored contiguously in a safetensors file: its dtype, shape and byte offset there."""

    def __init__(self, file: Path, name: str, dtype: torch.dtype, shape: torch.Size, begin: int) -> None:
        self.file, self.name, self.dtype, self.shape, self.begin = file, name, dtype, shape, begin

    def read(self) -> torch.Tensor:
        return self.read_rows(0, self.shape[0]) if self.shape else self._read(torch.empty((), dtype=self.dtype), 0)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        tensor = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        return self._read(tensor, start * tensor[:1].numel() * tensor.element_size())

    def _read(self, tensor: torch.Tensor, skip: int) -> torch.Tensor:
        """Read `tensor`'s bytes straight into its memory (a numpy view would make its storage unresizable for
        FSDP2), from `skip` bytes into this tensor, in several reads where one read(2) returns less (Linux stops at
        2 GiB)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes:
            return tensor
        view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
        with open(self.file, "rb", buffering=0) as fh:
            fh.seek(self.begin + skip)
            done = 0
            while done < nbytes:
                got = fh.readinto(view[done:])
                if not got:
                    raise UserError(f"--model: {self.file} is truncated (ends inside {self.name}); re-download it")
                done += got
        LOAD.bytes_read += nbytes
        return tensor


class LoadedRef(Lazy):
    """A tensor already at hand (a memory-mapped pickle's): read is a view of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.dtype, self.shape = tensor, tensor.dtype, tensor.shape

    def read(self) -> torch.Tensor:
        return self.tensor

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop]


def safetensors_refs(
    file: Path, dtypes: dict[str, torch.dtype] = SAFETENSORS_DTYPES
) -> Iterator[tuple[str, TensorRef]]:
    """(name, reference) in file order, nothing read; a dtype outside `dtypes` is refused, and so are offsets that
    do not fit the file.

    Read through plain reads, not safetensors' memory map: every page of a mapped shard that is touched stays in
    this process's resident set until the file is closed, which would put a whole shard into each rank's peak.
    Plain reads go through the page cache, which is the machine's, not the process's.
    """
    file_size = file.stat().st_size
    size, header = safetensors_header(file)
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = dtypes.get(info["dtype"])
        if dtype is None:
            raise UserError(f"--model: {file} stores {name} as {info['dtype']}, which this loader cannot read")
        begin, end = info["data_offsets"]
        shape = torch.Size(info["shape"])
        # The bytes are read straight into a tensor: they must be exactly its size and inside the file.
        if not 0 <= begin <= end <= file_size - 8 - size or end - begin != shape.numel() * dtype.itemsize:
            raise UserError(f"--model: {file} has a corrupt header ({name}'s offsets do not fit); re-download it")
        yield name, TensorRef(file, name, dtype, shape, 8 + size + begin)


def read_safetensors(
    file: Path, dtypes: dict[str, torch.dtype] = SAFETENSORS_DTYPES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order, each read into fresh memory (see safetensors_refs)."""
    for name, ref in safetensors_refs(file, dtypes):
        yield name, ref.read()


def tensor_names(file: Path) -> list[str]:
    """The names a weight file holds, without reading its tensors (a pickle's come from its memory-mapped index)."""
    if file.suffix == ".safetensors":
        return list(safetensors_header(file)[1])
    return list(torch.load(file, map_location="meta", weights_only=True, mmap=True))


def tensor_refs(file: Path, dtypes: dict[str, torch.dtype] = SAFETENSORS_DTYPES) -> Iterator[tuple[str, Lazy]]:
    """(name, reference) one at a time, nothing read yet: safetensors from disk; pickle only with weights_only,
    memory-mapped."""
    if file.suffix == ".safetensors":
        yield from safetensors_refs(file, dtypes)
    else:
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True, mmap=True).items():
            yield name, LoadedRef(tensor)
