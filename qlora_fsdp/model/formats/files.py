"""Reading a weight file's tensors one at a time: safetensors into fresh memory, pickle only with weights_only.

Every checkpoint format (qlora_fsdp/model/formats/) reads its files through here; what it makes of the tensors is
its own.
"""

from __future__ import annotations

import ctypes
import json
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


def read_safetensors(
    file: Path, dtypes: dict[str, torch.dtype] = SAFETENSORS_DTYPES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order, each read into fresh memory; a dtype outside `dtypes` is refused.

    Not through safetensors' memory map: every page of a mapped shard that is touched stays in this process's
    resident set until the file is closed, which would put a whole shard into each rank's peak. Plain reads go
    through the page cache, which is the machine's, not the process's.
    """
    file_size = file.stat().st_size
    size, header = safetensors_header(file)
    with open(file, "rb", buffering=0) as fh:
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            dtype = dtypes.get(info["dtype"])
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


def tensor_names(file: Path) -> list[str]:
    """The names a weight file holds, without reading its tensors (a pickle's come from its memory-mapped index)."""
    if file.suffix == ".safetensors":
        return list(safetensors_header(file)[1])
    return list(torch.load(file, map_location="meta", weights_only=True, mmap=True))


def read_tensors(file: Path, dtypes: dict[str, torch.dtype] = SAFETENSORS_DTYPES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time: safetensors from disk; pickle only with weights_only, memory-mapped."""
    if file.suffix == ".safetensors":
        yield from read_safetensors(file, dtypes)
    else:
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()
