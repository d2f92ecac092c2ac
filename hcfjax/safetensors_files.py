"""safetensors files, one tensor at a time: a checkpoint's index, checked before any data is read, positioned reads
of single tensors, and a writer that streams tensors into shards planned from their names, dtypes and shapes.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets into
the data section), then the data. A tensor is read with positioned reads into a fresh array rather than a memory
map: mapped pages stay resident, and count against the process, until the map is closed, so reading a 5 GB shard
through one map holds the shard rather than the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"

# safetensors dtype names -> numpy dtypes (bf16 and fp8 through ml_dtypes)
DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded for its config: missing, unexpected, misshapen or unreadable tensors,
    named with their file."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file and absolute byte range, with the header's dtype name and shape."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def where(self) -> str:
        return f"{self.name!r} in {self.file.name}"


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, each checked to lie inside the file with as many bytes as its dtype and
    shape need (a truncated shard fails here, naming the first tensor it cuts)."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{file} is truncated: its header needs {8 + n} bytes, the file has {size}")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} has an unreadable safetensors header ({e})") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape, dtype = tuple(info["shape"]), info["dtype"]
        where = f"tensor {name!r} in {file}"
        if dtype not in DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype}, which hcfjax does not read")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != want:
            raise CheckpointError(f"{where} spans {end - begin} bytes; {dtype} {list(shape)} needs {want}")
        if 8 + n + end > size:
            raise CheckpointError(
                f"{file} is truncated: tensor {name!r} ends at byte {8 + n + end}, the file has {size}"
            )
        entries[name] = TensorEntry(name, file, dtype, shape, 8 + n + begin, 8 + n + end)
    return entries


_SHARD_NAME = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


def read_index(path: Path) -> dict[str, TensorEntry]:
    """name -> TensorEntry for every tensor of the checkpoint directory `path`, read from the file headers alone.

    With model.safetensors.index.json, the files its weight map names are the checkpoint: each must exist and hold
    the tensors mapped to it. Without one, the *.safetensors files are (shards named X-0000i-of-0000N must all be
    there). No tensor may be in two files."""
    index = path / INDEX
    if index.is_file():
        weight_map = _weight_map(index)
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, []).append(name)
        entries = {}
        for fname, names in sorted(by_file.items()):
            file = path / fname
            if not file.is_file():
                raise CheckpointError(f"checkpoint {path} is missing {fname}, which {INDEX} names for {_some(names)}")
            header = read_header(file)
            absent = [n for n in names if n not in header]
            if absent:
                raise CheckpointError(f"{INDEX} maps {_some(absent)} to {fname}, which lacks it")
            _add(entries, header)
        return entries
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights at {path}")
    _check_shard_set(path, files)
    entries = {}
    for file in files:
        _add(entries, read_header(file))
    return entries


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> a file beside the index), or a CheckpointError naming the index."""
    try:
        d = json.loads(index.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"{index} is not valid JSON: {e}") from None
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map object of tensor names and files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\\" in file:
            raise CheckpointError(f"{index}: weight_map maps {name!r} to {file!r:.60}, not a file beside the index")
    return weight_map


def _add(entries: dict[str, TensorEntry], header: dict[str, TensorEntry]) -> None:
    """Adds a file's tensors (all of them, as transformers loads a shard whole); a name in two files is an error."""
    for name, e in header.items():
        if name in entries:
            raise CheckpointError(f"tensor {name!r} is in both {entries[name].file.name} and {e.file.name}")
        entries[name] = e


def _check_shard_set(path: Path, files: list[Path]) -> None:
    for f in files:
        m = _SHARD_NAME.fullmatch(f.name)
        if m:
            count = int(m.group(3))
            want = [f"{m.group(1)}-{i:0{len(m.group(2))}d}-of-{m.group(3)}.safetensors" for i in range(1, count + 1)]
            missing = [w for w in want if not (path / w).is_file()]
            if missing:
                raise CheckpointError(f"checkpoint {path} has no {INDEX} and is missing {missing[0]} of {count}")


def _some(names: list[str]) -> str:
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"tensor {names[0]!r}{more}"


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """The tensor's values, read from its file into a new array."""
    out = np.empty(entry.shape, DTYPES[entry.dtype])
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    with open(entry.file, "rb", buffering=0) as fh:
        fh.seek(entry.begin)
        while done < len(view):
            got = fh.readinto(view[done:])
            if not got:
                raise CheckpointError(
                    f"{entry.file} is truncated: tensor {entry.name!r} ends at byte {entry.end}, reading stopped at "
                    f"{entry.begin + done}"
                )
            done += got
    return out


# ---- writing ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Planned:
    """A tensor to be written: name, numpy dtype and shape, known before its values are."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def plan_shards(tensors: list[Planned], shard_bytes: int) -> dict[str, list[Planned]]:
    """File name -> its tensors, in order, each file up to `shard_bytes` (transformers' names: model.safetensors,
    or model-0000i-of-0000N.safetensors)."""
    groups: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if size + t.nbytes > shard_bytes and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def write_shards(path: Path, tensors: list[Planned], values: Callable[[Planned], np.ndarray], shard_bytes: int):
    """Writes `tensors` as safetensors shards under `path` (with an index when there are several), asking
    `values(t)` for each tensor's array in order and writing it at once: each file's header is written first from
    the plan, so host memory holds one tensor, not a shard."""
    shards = plan_shards(tensors, shard_bytes)
    for fname, planned in shards.items():
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in planned:
            dtype = DTYPE_NAMES[np.dtype(t.dtype)]
            header[t.name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        with open(path / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for t in planned:
                a = np.ascontiguousarray(values(t))
                if a.dtype != np.dtype(t.dtype) or a.shape != tuple(t.shape):
                    raise ValueError(f"{t.name}: got {a.dtype} {a.shape}, planned {np.dtype(t.dtype)} {t.shape}")
                fh.write(a.reshape(-1).view(np.uint8).data)
    if len(shards) > 1:
        weight_map = {t.name: fname for fname, planned in shards.items() for t in planned}
        total = sum(t.nbytes for t in tensors)
        (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
