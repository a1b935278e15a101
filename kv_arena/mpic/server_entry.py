"""One media entry as it lies on the shared server (:mod:`.server_store`), and what it must pass
to be read: a hash with one field per tensor (its raw bytes) and ``meta`` (JSON).

* Bound to its name: the metadata holds the entry's server name (format version, tenant digest,
  model, content hash), and each tensor's CRC-32 is chained from that name, the tensor's name,
  dtype and shape. The same bytes under any other name (another picture's, tenant's or model's),
  or with another shape, fail a check: a miss, never another picture's KV.
* Strict: every metadata field that is read is checked for its type and range before use
  (:func:`checked_meta`), so a malformed entry is a miss at lookup and cannot make a load fail
  half-way with anything but :class:`~.kv_store.CorruptEntry`.
"""

from __future__ import annotations

import json
import math
import zlib

import torch

from .kv_store import CorruptEntry

FORMAT = 2  # in every key name and every entry's metadata: other versions never meet ours
META = "meta"
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.uint8, torch.bool)}
NOT_SERVED = "prefix"  # token prefixes live in one process's memory: none read from a server joins them
MAX_DIMS = 8


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def field_crc(data: bytes, name: str, field: str, dtype: str, shape: list[int]) -> int:
    """A tensor's CRC-32, chained from where it belongs: the same bytes elsewhere check as damaged."""
    return zlib.crc32(data, zlib.crc32(json.dumps([name, field, dtype, shape]).encode()))


def wire_meta(meta: dict, name: str, key: str, tensors: dict[str, torch.Tensor], fields: dict[str, bytes]) -> dict:
    """The entry's metadata on the server: the local store's, plus the format, the name, the key,
    and each tensor's dtype, shape and bound checksum."""
    dtype = {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()}
    shape = {n: list(t.shape) for n, t in tensors.items()}
    return dict(meta, format=FORMAT, name=name, key=key, dtype=dtype, shape=shape,
                crc={n: field_crc(fields[n], name, n, dtype[n], shape[n]) for n in tensors})


def _count(value, high: int | None = None) -> bool:
    """A non-negative Python int (not a bool, not a float that happens to be whole)."""
    return type(value) is int and value >= 0 and (high is None or value < high)


def _tensors_whole(meta: dict) -> bool:
    """Names, dtypes, shapes, checksums and the byte count agree, each of its expected type."""
    names = meta.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return False
    if len(set(names)) != len(names) or META in names:
        return False
    tables = [meta.get(f) for f in ("dtype", "shape", "crc")]
    if not all(isinstance(t, dict) and set(t) == set(names) for t in tables):
        return False
    dtype, shape, crc = tables
    for n in names:
        if not (isinstance(dtype[n], str) and dtype[n] in DTYPES and _count(crc[n], 2**32)):
            return False
        if not (isinstance(shape[n], list) and len(shape[n]) <= MAX_DIMS and all(_count(d) for d in shape[n])):
            return False
    size = sum(math.prod(shape[n]) * DTYPES[dtype[n]].itemsize for n in names)
    return _count(meta.get("bytes")) and meta["bytes"] == size


def _labels_plain(meta: dict) -> bool:
    """What the library and the status lines show: plain values of their types."""
    created = meta.get("created")
    return (type(created) in (int, float) and math.isfinite(created) and isinstance(meta.get("kind"), str)
            and meta["kind"] != NOT_SERVED
            and isinstance(meta.get("label", ""), str)
            and all(meta.get(f) is None or _count(meta[f]) for f in ("tokens", "layers")))


def checked_meta(raw: bytes | None, name: str, model: str, key: str) -> dict | None:
    """The server's metadata of the entry ``name`` if it is ours and whole (the module docstring);
    None otherwise."""
    if not isinstance(raw, bytes):
        return None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(meta, dict) or type(meta.get("format")) is not int or meta["format"] != FORMAT:
        return None
    if meta.get("name") != name or meta.get("key") != key or meta.get("model") != model:
        return None
    return meta if _tensors_whole(meta) and _labels_plain(meta) else None


def read_tensor(data: bytes | None, meta: dict, field: str) -> torch.Tensor:
    """One stored tensor of a :func:`checked_meta` entry; :class:`CorruptEntry` if it does not match."""
    dtype, shape = meta["dtype"][field], meta["shape"][field]
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * DTYPES[dtype].itemsize:
        raise CorruptEntry(f"'{field}' is missing or has the wrong size")
    if field_crc(data, meta["name"], field, dtype, shape) != meta["crc"][field]:
        raise CorruptEntry(f"checksum mismatch in '{field}' (damaged, or stored under another name)")
    if not data:
        return torch.empty(shape, dtype=DTYPES[dtype])
    return torch.frombuffer(bytearray(data), dtype=DTYPES[dtype]).reshape(shape)
