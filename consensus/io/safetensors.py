"""Safetensors checkpoints in and out: single files and Hugging Face sharded folders, no torch, no pickle.

Layouts (the Hugging Face conventions, so checkpoints move both ways):

* a single file ``*.safetensors``;
* a folder holding ``model.safetensors`` (one shard), or shards
  ``model-00001-of-00003.safetensors`` ... and ``model.safetensors.index.json``
  (``{"metadata": {"total_size": bytes}, "weight_map": {key: shard file}}``).

Keys are flat dotted paths of the tree (``encoder.layer_0.kernel``, see
:mod:`consensus.io.keys`); dtypes are kept bit for bit, bfloat16 included
(numpy's bfloat16 is ``ml_dtypes.bfloat16``, which jax uses too).

Reading opens every file with the ``safetensors`` package's numpy API
(``safe_open``: header, keys, dtypes, shapes, validated by the reference
implementation) and reads each tensor's bytes with a positional read
(``os.preadv``) at the offsets of the header, straight into the caller's
buffer. A memory-mapped read would be as fast, but every page it touches
counts in the process's resident memory until the file is closed: a merge of
eight 1 GB inputs would show 8 GB RSS while holding one leaf at a time.

Writing a whole tree in memory uses its ``save_file``; :class:`ShardedWriter`
writes tensor by tensor instead (the package's writer needs every tensor of a
file at once), so a merge can stream a
model larger than memory: shapes and dtypes are known up front, so the header
is written first and the data appended in order. Every write goes to a
temporary name and is renamed into place at the end (readers never see half a
checkpoint), and an existing path is never replaced unless ``overwrite=True``.

Every file this module writes carries ``{"format": "pt"}`` in its ``__metadata__`` (beside the
caller's own keys), which Hugging Face's readers require, and its header is written in a fixed
order (metadata keys sorted, tensors in the tree's order), so the same tree gives the same bytes.
A scalar leaf is stored with shape ``()`` and reads back as one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from consensus.io.keys import CheckpointKeyError, KeyMapping, check_against, flatten, unflatten

PyTree = Any
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The metadata Hugging Face's loaders ask for ("format" must be one of pt, tf, flax, mlx); the
# tensors are plain little-endian arrays, which every framework's reader takes.
FORMAT_METADATA = {"format": "pt"}

# safetensors dtype codes <-> numpy dtypes (bfloat16 and float8 from ml_dtypes).
DTYPE_CODES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODE_OF: dict[np.dtype, str] = {v: k for k, v in DTYPE_CODES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written (missing file, bad layout, existing output)."""


def dtype_code(dtype: Any) -> str:
    """Return the safetensors code of a numpy dtype (``"F32"``, ``"BF16"``, ...).

    Args:
      dtype: A numpy dtype (or anything ``np.dtype`` accepts).

    Returns:
      The code.

    Raises:
      CheckpointError: If safetensors cannot store the dtype.
    """
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors; supported: {sorted(CODE_OF)}")
    return CODE_OF[dtype]


def parse_size(size: int | str | None) -> int | None:
    """Read a size in bytes from an int or a string such as ``"500MB"``, ``"2GB"``, ``"1.5GiB"``.

    Args:
      size: Bytes, a string with a unit (K, M, G, T; ``i`` for powers of 1024), or None.

    Returns:
      The number of bytes, or None for None.

    Raises:
      ValueError: If the size is not positive or cannot be read.
    """
    if size is None or isinstance(size, int):
        if isinstance(size, int) and size < 1:
            raise ValueError(f"shard size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read shard size {size!r}; use bytes or e.g. '500MB', '2GB'")
    base = 1024 if m[3] else 1000
    power = " KMGT".index(m[2].upper() or " ")
    value = int(float(m[1]) * base**power)
    if value < 1:
        raise ValueError(f"shard size must be positive, got {size!r}")
    return value


# ----------------------------------------------------------------------------- atomic paths


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} exists; choose another path or pass overwrite=True")


def _replace(tmp: Path, path: Path, overwrite: bool) -> None:
    """Move ``tmp`` to ``path``; an existing ``path`` is removed only with ``overwrite``."""
    _refuse_existing(path, overwrite)
    if path.is_dir():
        old = _temp_sibling(path)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``path`` that becomes ``path`` when the block ends without error.

    Args:
      path: The folder to create.
      overwrite: Replace an existing ``path``.

    Yields:
      The temporary folder (removed if the block raises).

    Raises:
      CheckpointError: If ``path`` exists and ``overwrite`` is False.
    """
    path = Path(path)
    _refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        _replace(tmp, path, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# ----------------------------------------------------------------------------- writing


def plan_shards(sizes: Mapping[str, int], shard_size: int | None) -> list[list[str]]:
    """Group keys into shards in order, each at most ``shard_size`` bytes (a larger tensor gets its own).

    Args:
      sizes: Key -> bytes, in write order.
      shard_size: Bytes per shard, or None for one shard.

    Returns:
      The keys of every shard.
    """
    shards: list[list[str]] = [[]]
    used = 0
    for key, nbytes in sizes.items():
        if shard_size is not None and shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """Return the file names of ``count`` shards (``model.safetensors`` for one).

    Args:
      count: The number of shards.

    Returns:
      ``["model.safetensors"]`` or ``["model-00001-of-0000N.safetensors", ...]``.
    """
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class DirectFile:
    """A write-only file written with ``O_DIRECT`` through an aligned staging buffer (Linux).

    Writing a large file through the page cache costs a fresh page per 4 KiB, and on a
    virtual machine whose memory the host backs lazily the first touch of each page is
    what dominates: buffered writes into fresh memory then cost several times what
    ``O_DIRECT`` costs (which also leaves the page cache to the inputs a merge is reading;
    ``python -m benchmarks merge_io`` times whole merges that write this way). Bytes are staged in an aligned
    buffer and written in aligned blocks; :meth:`close` writes the padded last block and
    truncates the file to its true length. Where the file system refuses ``O_DIRECT``
    (tmpfs, some network file systems), the file is written the ordinary way.

    Args:
      path: the file to create (truncated if it exists).

    Raises:
      OSError: the file cannot be created.
    """

    BLOCK = 4096
    STAGE = 8 << 20

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.flushed = 0  # bytes on disk (a multiple of BLOCK while direct)
        raw = np.empty(self.STAGE + self.BLOCK, np.uint8)
        start = -raw.ctypes.data % self.BLOCK
        self.stage = raw[start : start + self.STAGE]
        self.used = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError:
            self.direct = False
            self.fd = os.open(self.path, flags, 0o644)

    def write(self, data: Any) -> None:
        """Append the bytes of ``data`` (any buffer), flushing whole staged blocks."""
        view = np.frombuffer(data, np.uint8)
        done = 0
        while done < view.size:
            take = min(self.STAGE - self.used, view.size - done)
            self.stage[self.used : self.used + take] = view[done : done + take]
            self.used += take
            done += take
            if self.used == self.STAGE:
                self._flush(self.STAGE)

    def _flush(self, nbytes: int) -> None:
        """Write the first ``nbytes`` (a multiple of BLOCK while direct) of the stage."""
        out = memoryview(self.stage[:nbytes])  # type: ignore[arg-type]  # numpy: __buffer__ from 3.12
        while out:
            try:
                got = os.write(self.fd, out)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise  # a full disk, an I/O error: the caller's error, not the mode's
                self._fall_back()  # the file system took O_DIRECT at open but not in a write
                continue
            out = out[got:]
            self.flushed += got
        keep = self.used - nbytes
        if keep:
            self.stage[:keep] = self.stage[nbytes : self.used]
        self.used = keep

    def _fall_back(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY)
        os.lseek(self.fd, self.flushed, os.SEEK_SET)
        self.direct = False

    def close(self) -> None:
        """Write what is staged (padded to a block while direct), truncate to the true length, close."""
        if self.fd < 0:
            return
        try:
            if self.used:
                if self.direct:
                    padded = -(-self.used // self.BLOCK) * self.BLOCK
                    self.stage[self.used : padded] = 0
                    true_size, self.used = self.flushed + self.used, padded
                    self._flush(padded)
                    os.ftruncate(self.fd, true_size)
                else:
                    self._flush(self.used)
        finally:
            os.close(self.fd)
            self.fd = -1


class ShardedWriter:
    """Writes a checkpoint folder tensor by tensor, in the order of ``specs``.

    The header of every shard is written when the shard is opened (shapes and
    dtypes are known from ``specs``), then :meth:`write` appends each tensor's
    bytes, so memory holds one tensor at a time. Call :meth:`close` after the
    last tensor; it checks that every tensor was written and writes the index.

    Args:
      directory: an existing (temporary) folder to write into, see :func:`atomic_directory`.
      specs: key -> (shape, dtype), in write order.
      shard_size: bytes per shard (None: one file).
      metadata: str -> str stored in every shard's header (``__metadata__``) beside
        :data:`FORMAT_METADATA`, keys sorted (a caller's own ``format`` wins).
      direct: write the shards with ``O_DIRECT`` (:class:`DirectFile`), bypassing the page cache.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        specs: Mapping[str, tuple[tuple[int, ...], Any]],
        *,
        shard_size: int | None = None,
        metadata: Mapping[str, str] | None = None,
        direct: bool = False,
    ):
        self.direct = direct
        self.directory = Path(directory)
        self.specs = {k: (tuple(int(d) for d in s), np.dtype(t)) for k, (s, t) in specs.items()}
        self.metadata = metadata_of(metadata)
        nbytes = {k: int(np.prod(s, dtype=np.int64)) * t.itemsize for k, (s, t) in self.specs.items()}
        self.nbytes = nbytes
        self.shards = plan_shards(nbytes, shard_size)
        self.names = shard_names(len(self.shards))
        self._shard_of = {k: i for i, keys in enumerate(self.shards) for k in keys}
        self._order = list(self.specs)
        self._next = 0
        self._file: Any = None
        self._open_index = -1

    def _open_shard(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        header: dict[str, Any] = {}
        if self.metadata:
            header["__metadata__"] = self.metadata
        offset = 0
        for key in self.shards[index]:
            shape, dtype = self.specs[key]
            header[key] = {
                "dtype": dtype_code(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + self.nbytes[key]],
            }
            offset += self.nbytes[key]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
        target = self.directory / self.names[index]
        self._file = DirectFile(target) if self.direct else open(target, "wb")  # noqa: SIM115 (closed in close())
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)
        self._open_index = index

    def write(self, key: str, array: Any) -> None:
        """Append ``array`` as ``key`` (the next key of ``specs``; shape and dtype checked).

        Args:
          key: The next key of ``specs``.
          array: Its tensor.

        Raises:
          CheckpointError: If ``key`` is not the next one or the array's shape or dtype differs.
        """
        self._check_next(key)
        array = np.asarray(array)
        shape, dtype = self.specs[key]
        if array.shape != shape or array.dtype != dtype:
            raise CheckpointError(
                f"ShardedWriter: {key!r} is {array.dtype}{list(array.shape)}, declared {dtype}{list(shape)}"
            )
        self._append(key, [array.reshape(-1)])

    def write_parts(self, key: str, parts: Sequence[Any]) -> None:
        """Append ``key`` given as consecutive pieces of its flattened values (each 1-D, its dtype).

        For a caller that produces a tensor in pieces (``meta-consensus merge``'s column
        chunks): the pieces go to the file as they are, never assembled in memory.

        Args:
          key: The next key of ``specs``.
          parts: 1-D arrays of the key's dtype whose sizes add up to the tensor's.

        Raises:
          CheckpointError: If ``key`` is not the next one or the pieces do not make up the tensor.
        """
        self._check_next(key)
        shape, dtype = self.specs[key]
        parts = [np.asarray(p) for p in parts]
        bad = [p for p in parts if p.dtype != dtype or p.ndim != 1]
        total = sum(p.size for p in parts)
        if bad or total != int(np.prod(shape, dtype=np.int64)):
            got = f"{len(parts)} pieces of {total} values" + (
                f", one {bad[0].dtype}{list(bad[0].shape)}" if bad else ""
            )
            raise CheckpointError(f"ShardedWriter: {key!r} is {dtype}{list(shape)}, got {got}")
        self._append(key, parts)

    def _check_next(self, key: str) -> None:
        if self._next >= len(self._order) or self._order[self._next] != key:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing (all written)"
            raise CheckpointError(f"ShardedWriter: got {key!r}, expected {expected!r} next")

    def _append(self, key: str, parts: Sequence[np.ndarray]) -> None:
        """Write ``key``'s checked 1-D pieces, little-endian, into its shard."""
        shard = self._shard_of[key]
        if shard != self._open_index:
            self._open_shard(shard)
        for part in parts:
            part = np.ascontiguousarray(part)
            if part.dtype.byteorder == ">":
                part = part.byteswap().view(part.dtype.newbyteorder("<"))
            self._file.write(part.view(np.uint8).data)
        self._next += 1

    def close(self) -> None:
        """Close the last shard and write the index of a sharded folder.

        Raises:
          CheckpointError: If some tensor of ``specs`` was never written.
        """
        self.abort()  # closes the open shard
        if self._next != len(self._order):
            raise CheckpointError(
                f"ShardedWriter: {self._order[self._next]!r} and later tensors were never written"
            )
        if not self._order:  # an empty checkpoint is still a valid file
            self._open_shard(0)
            self.abort()
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": sum(self.nbytes.values()), **self.metadata},  # total_size first
                "weight_map": {k: self.names[self._shard_of[k]] for k in self._order},
            }
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        """Close the open shard file, if any."""
        if self._file is not None:
            self._file.close()
            self._file = None


def metadata_of(metadata: Mapping[str, Any] | None) -> dict[str, str]:
    """Return the ``__metadata__`` written: :data:`FORMAT_METADATA` and the caller's keys, as strings, sorted.

    Args:
      metadata: The caller's metadata, or None.

    Returns:
      The merged str -> str dict (a caller's ``format`` wins).
    """
    merged = {**FORMAT_METADATA, **{str(k): str(v) for k, v in (metadata or {}).items()}}
    return dict(sorted(merged.items()))


def save_safetensors(
    tree: PyTree,
    path: str | os.PathLike,
    *,
    shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a tree as safetensors: a single file when ``path`` ends in ``.safetensors``, else a folder.

    Args:
      tree: nested dicts (or any pytree) of arrays (numpy or jax; moved to the host).
      path: ``*.safetensors`` (one file) or a folder (``model.safetensors``, or shards
        and ``model.safetensors.index.json`` when the tree exceeds ``shard_size``).
      shard_size: bytes (or ``"2GB"``) per shard of a folder; None writes one shard.
      metadata: str -> str stored in the header, beside ``{"format": "pt"}`` (keys sorted).
      overwrite: replace an existing path (by default an existing path is an error).

    Returns:
      the path written.

    Raises:
      CheckpointError: If ``path`` exists without ``overwrite`` or a dtype cannot be stored.
      CheckpointKeyError: If the tree's keys cannot be written as dotted keys.
      ValueError: If ``shard_size`` cannot be read.
    """
    path = Path(path)
    flat = {k: np.asarray(v) for k, v in flatten(tree).items()}
    for v in flat.values():
        dtype_code(v.dtype)  # a clear error before anything is written
    shard_size = parse_size(shard_size)
    if path.suffix == ".safetensors":
        if (
            shard_size is not None
            and len(plan_shards({k: v.nbytes for k, v in flat.items()}, shard_size)) > 1
        ):
            raise CheckpointError(f"{path}: a single .safetensors file cannot be sharded; give a folder path")
        # The package's own writer (the safetensors package's save_file stores a 0-d array as
        # shape (1,) and writes metadata in hash order): one shard in a temporary folder, moved.
        _refuse_existing(path, overwrite)
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = _temp_sibling(path)
        folder.mkdir()
        try:
            _write_flat(folder, flat, None, metadata)
            _replace(folder / SINGLE_NAME, path, overwrite)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return path
    with atomic_directory(path, overwrite=overwrite) as tmp:
        _write_flat(tmp, flat, shard_size, metadata)
    return path


def _write_flat(
    folder: Path, flat: Mapping[str, np.ndarray], shard_size: int | None, metadata: Mapping[str, str] | None
) -> None:
    writer = ShardedWriter(
        folder, {k: (v.shape, v.dtype) for k, v in flat.items()}, shard_size=shard_size, metadata=metadata
    )
    try:
        for k, v in flat.items():
            writer.write(k, v)
    finally:
        writer.abort()
    writer.close()


# ----------------------------------------------------------------------------- reading


def checkpoint_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, Path] | None]:
    """The shard files of a checkpoint and, for a sharded one, its weight map (key -> file).

    ``path`` may be a ``.safetensors`` file, an ``*.index.json`` file, or a folder
    holding ``model.safetensors.index.json``, ``model.safetensors`` or a single
    ``*.safetensors`` file.

    Args:
      path: The checkpoint's file, index or folder.

    Returns:
      ``(files, weight_map)``; ``weight_map`` is None for a single file.

    Raises:
      CheckpointError: If the path is missing, the folder ambiguous, the index unreadable or
        a shard it names missing.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} not found")
    index_path = None
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            index_path = path / INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            return [path / SINGLE_NAME], None
        else:
            indexes = sorted(path.glob("*.safetensors.index.json"))
            files = sorted(path.glob("*.safetensors"))
            if len(indexes) == 1:
                index_path = indexes[0]
            elif len(files) == 1 and not indexes:
                return files, None
            else:
                raise CheckpointError(
                    f"{path}: no {INDEX_NAME} or {SINGLE_NAME}, and {len(files)} .safetensors files / "
                    f"{len(indexes)} index files: cannot tell which is the checkpoint"
                )
    elif path.name.endswith(".index.json"):
        index_path = path
    else:
        return [path], None
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a safetensors index (needs a 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: 'weight_map' must map keys to shard files")
    where = {str(k): index_path.parent / str(v) for k, v in weight_map.items()}
    files = sorted(set(where.values()))
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{index_path} names shard {f.name}, which does not exist")
    return files, where


def _data_offsets(path: Path, fd: int) -> dict[str, tuple[int, int]]:
    """Key -> absolute (begin, end) offsets of its bytes in the file (safe_open validated the header)."""
    (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, size, 8))
    start = 8 + size
    return {
        k: (start + int(v["data_offsets"][0]), start + int(v["data_offsets"][1]))
        for k, v in header.items()
        if k != "__metadata__"
    }


class CheckpointReader:
    """Lazy, memory-mapped access to a safetensors checkpoint (file or sharded folder), one tensor at a time.

    Attributes:
      path: what was opened.
      specs: key -> (shape, dtype) after the mapping, in storage order.
      metadata: the ``__metadata__`` of the first shard (str -> str).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike, *, mapping: KeyMapping | None = None):
        from safetensors import safe_open

        self.path = Path(path)
        self.mapping = mapping or KeyMapping()
        files, where = checkpoint_files(self.path)
        self._handles: dict[Path, Any] = {}
        self._fds: dict[Path, int] = {}
        self._offsets: dict[str, tuple[int, int]] = {}  # stored key -> absolute (begin, end) in its file
        stored: dict[str, tuple[Path, tuple[int, ...], np.dtype]] = {}
        self.metadata: dict[str, str] = {}
        try:
            for f in files:
                try:
                    handle = safe_open(str(f), framework="np")
                except Exception as e:  # the Rust reader raises its own error types
                    raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
                self._handles[f] = handle
                self._fds[f] = os.open(f, os.O_RDONLY)
                self._offsets.update(_data_offsets(f, self._fds[f]))
                if not self.metadata:
                    self.metadata = dict(handle.metadata() or {})
                for key in handle.offset_keys():
                    if key in stored:
                        raise CheckpointError(f"{self.path}: key {key!r} is stored in two shards")
                    piece = handle.get_slice(key)
                    code = piece.get_dtype()
                    if code not in DTYPE_CODES:
                        raise CheckpointError(
                            f"{f}: {key!r} has dtype {code}, which this reader does not support"
                        )
                    stored[key] = (f, tuple(piece.get_shape()), DTYPE_CODES[code])
        except BaseException:
            self.close()
            raise
        if where is not None:
            missing = sorted(set(where) - set(stored))
            misplaced = sorted(k for k in where if k in stored and stored[k][0] != where[k])
            if missing or misplaced:
                self.close()
                raise CheckpointError(
                    f"{self.path}: the index names keys its shards do not hold where it says: "
                    f"{(missing + misplaced)[:5]}"
                )
        renamed = self.mapping.rename_all(stored)
        self._source = {new: old for new, old in renamed.items()}
        self._stored = stored
        self.specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            new: (self.mapping.apply_shape(new, stored[old][1]), stored[old][2])
            for new, old in renamed.items()
        }

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the memory maps and file descriptors."""
        for handle in self._handles.values():
            with contextlib.suppress(Exception):
                handle.__exit__(None, None, None)
        self._handles = {}
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def keys(self) -> list[str]:
        """Return the (mapped) keys, in storage order."""
        return list(self.specs)

    def nbytes(self, key: str) -> int:
        """Return the size in bytes of the tensor ``key``."""
        shape, dtype = self.specs[key]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def get(self, key: str) -> np.ndarray:
        """Read the tensor ``key`` (a mapped name) as a numpy array, transposed when the mapping says so.

        Args:
          key: A mapped key.

        Returns:
          The array.

        Raises:
          CheckpointKeyError: If the checkpoint has no such key.
          CheckpointError: If the stored bytes do not match the tensor's shape and dtype.
        """
        if key not in self._source:
            raise CheckpointKeyError(f"{self.path} has no key {key!r}")
        old = self._source[key]
        _, shape, dtype = self._stored[old]
        array = np.empty(shape, dtype)
        self._read_stored(old, array)
        return self.mapping.apply_array(key, array)

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read the tensor ``key`` into ``out`` (C-contiguous, its shape and dtype) without a copy.

        Args:
          key: A mapped key.
          out: The destination array.

        Raises:
          CheckpointKeyError: If the checkpoint has no such key.
          ValueError: If ``out`` is not C-contiguous of the tensor's shape and dtype.
        """
        if key not in self._source:
            raise CheckpointKeyError(f"{self.path} has no key {key!r}")
        shape, dtype = self.specs[key]
        if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"read_into {key!r}: out must be C-contiguous {shape} {dtype}, got {out.shape} {out.dtype}"
            )
        old = self._source[key]
        if self.mapping.transposes(key):
            out[...] = self.get(key)
        else:
            self._read_stored(old, out)

    def read_range_into(self, key: str, start: int, out: np.ndarray) -> None:
        """Read elements ``[start, start + out.size)`` of the flattened tensor ``key`` into ``out``.

        ``out`` is a C-contiguous array of the tensor's dtype; the range is of the stored
        (row-major) order, so a key the mapping transposes cannot be read this way. Lets a
        caller stream a large tensor in column chunks that stay in cache (``meta-consensus
        merge``'s element-wise rules).

        Args:
          key: A mapped key.
          start: The first element, in stored order.
          out: The destination array.

        Raises:
          CheckpointKeyError: If the checkpoint has no such key.
          ValueError: If ``out`` is not C-contiguous of the tensor's dtype, the range falls
            outside the tensor, or the mapping transposes the key.
        """
        if key not in self._source:
            raise CheckpointKeyError(f"{self.path} has no key {key!r}")
        shape, dtype = self.specs[key]
        size = int(np.prod(shape, dtype=np.int64))
        if out.dtype != dtype or not out.flags.c_contiguous or start < 0 or start + out.size > size:
            raise ValueError(
                f"read_range_into {key!r}: out must be C-contiguous {dtype} within the {size} elements, "
                f"got {out.dtype} of {out.size} at {start}"
            )
        if self.mapping.transposes(key):
            raise ValueError(f"read_range_into {key!r}: the mapping transposes it; read it whole")
        old = self._source[key]
        self._read_stored(old, out, start * dtype.itemsize)

    def _read_stored(self, old: str, out: np.ndarray, skip: int | None = None) -> None:
        """Read the stored tensor ``old`` into ``out`` (all of it), or ``out.nbytes`` bytes after ``skip``."""
        f = self._stored[old][0]
        begin, end = self._offsets[old]
        view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # as in _flush
        _, shape, dtype = self._stored[old]
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != need or (skip is None and len(view) != need):
            raise CheckpointError(f"{f}: {old!r} holds {end - begin} bytes, its shape and dtype need {need}")
        begin += skip or 0
        done = 0
        while done < len(view):  # preadv may return fewer bytes than asked (large reads, signals)
            got = os.preadv(self._fds[f], [view[done:]], begin + done)
            if got <= 0:
                raise CheckpointError(f"{f}: {old!r} ends early (file truncated?)")
            done += got

    def check_against(self, like: PyTree) -> None:
        """Check every key, shape and dtype against the template ``like``.

        Args:
          like: The template tree.

        Raises:
          CheckpointKeyError: On a mismatch (see :func:`~consensus.io.keys.check_against`).
        """
        check_against(self.specs, like, str(self.path))


def load_safetensors(
    path: str | os.PathLike, like: PyTree | None = None, *, mapping: KeyMapping | None = None
) -> PyTree:
    """Read a safetensors checkpoint (file, folder or index) as a tree of numpy arrays.

    Args:
      path: a ``.safetensors`` file, a folder, or a ``*.index.json``.
      like: a template tree (arrays or ``jax.ShapeDtypeStruct``). When given, its
        keys, shapes and dtypes are checked (extra or missing keys are an error
        listing them; the first shape or dtype mismatch is named) and the result
        has its structure. Without it, nested dicts are built from the dotted keys.
      mapping: rename / transpose rules for checkpoints from other frameworks.

    Returns:
      The tree of numpy arrays.

    Raises:
      CheckpointError: If the checkpoint cannot be found or read.
      CheckpointKeyError: If it does not match ``like``, or the mapping renames two keys to one.
    """
    with CheckpointReader(path, mapping=mapping) as reader:
        if like is not None:
            reader.check_against(like)
        flat = {k: reader.get(k) for k in reader.specs}
    return unflatten(flat, like)
