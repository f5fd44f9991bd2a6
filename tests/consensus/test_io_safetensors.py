"""Safetensors in and out: bit-exact round trips, sharded folders, templates, key mappings, atomic writes."""

from __future__ import annotations

import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from consensus import io

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int8, np.bool_]


def _array(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    # Random bit patterns cover every exponent and sign (NaN payloads included): a bit-exact test.
    bits = rng.integers(0, 2 ** (8 * dtype.itemsize), size=shape, dtype=np.uint64)
    return bits.astype(f"u{dtype.itemsize}").view(dtype)


def _tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "encoder": {
            f"layer_{i}": {"kernel": _array(rng, (3, 5), d), "bias": _array(rng, (5,), d)}
            for i, d in enumerate(DTYPES)
        },
        "scale": _array(rng, (), np.float32),
    }


def _assert_bits_equal(a: dict, b: dict) -> None:
    fa, fb = io.flatten(a), io.flatten(b)
    assert list(fa) == list(fb)
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert x.tobytes() == y.tobytes(), k


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_single_file_round_trip_is_bit_exact_per_dtype(tmp_path, dtype):
    rng = np.random.default_rng(1)
    tree = {"w": _array(rng, (4, 7), dtype), "b": {"c": _array(rng, (7,), dtype)}}
    path = io.save_safetensors(tree, tmp_path / "m.safetensors")
    back = io.load_safetensors(path)
    _assert_bits_equal(tree, back)
    # The package's own reader sees the same bytes and dtype (an independent check of the format).
    ref = load_file(str(path))
    assert ref["b.c"].dtype == np.dtype(dtype) and ref["b.c"].tobytes() == tree["b"]["c"].tobytes()


def test_folder_round_trip_and_streamed_writer_match_the_package_reader(tmp_path):
    tree = _tree()
    folder = io.save_safetensors(tree, tmp_path / "ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    _assert_bits_equal(tree, io.load_safetensors(folder))
    # Our streamed header is read by safetensors' own loader, every dtype intact.
    ref = load_file(str(folder / "model.safetensors"))
    for k, v in io.flatten(tree).items():
        assert ref[k].dtype == v.dtype and ref[k].tobytes() == np.asarray(v).tobytes()


def test_sharded_folder_written_in_hugging_face_layout_and_read_back(tmp_path):
    tree = _tree(3)
    sizes = {k: np.asarray(v).nbytes for k, v in io.flatten(tree).items()}
    folder = io.save_safetensors(tree, tmp_path / "sharded", shard_size=40)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for name in shards:  # every shard stays under the limit unless it holds one bigger tensor
        with safe_open(str(folder / name), framework="np") as f:
            keys = list(f.keys())
            total = sum(sizes[k] for k in keys)
            assert total <= 40 or len(keys) == 1
            assert all(index["weight_map"][k] == name for k in keys)
    _assert_bits_equal(tree, io.load_safetensors(folder))
    _assert_bits_equal(tree, io.load_safetensors(folder / "model.safetensors.index.json"))


def test_reads_a_sharded_checkpoint_written_by_the_safetensors_package(tmp_path):
    rng = np.random.default_rng(4)
    a = {"model.embed.weight": rng.normal(size=(6, 4)).astype(np.float32)}
    b = {"model.head.weight": rng.normal(size=(4, 3)).astype(ml_dtypes.bfloat16)}
    (tmp_path / "hf").mkdir()
    save_file(a, str(tmp_path / "hf" / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "hf" / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 120},
        "weight_map": {
            "model.embed.weight": "model-00001-of-00002.safetensors",
            "model.head.weight": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    back = io.load_safetensors(tmp_path / "hf")
    assert back["model"]["embed"]["weight"].tobytes() == a["model.embed.weight"].tobytes()
    assert back["model"]["head"]["weight"].dtype == ml_dtypes.bfloat16
    assert back["model"]["head"]["weight"].tobytes() == b["model.head.weight"].tobytes()


def test_jax_arrays_and_template_structure(tmp_path):
    params = {
        "dense_0": {"kernel": jnp.ones((3, 2), jnp.bfloat16), "bias": jnp.zeros((2,))},
        "n": [jnp.arange(3)],
    }
    io.save_safetensors(params, tmp_path / "p.safetensors")
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    back = io.load_safetensors(tmp_path / "p.safetensors", like=like)
    assert jax.tree.structure(back) == jax.tree.structure(params)  # the list comes back as a list
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        assert np.asarray(x).tobytes() == y.tobytes() and np.asarray(x).dtype == y.dtype
    # Without a template, the dots give nested dicts (the list index becomes a key).
    assert set(io.load_safetensors(tmp_path / "p.safetensors")["n"]) == {"0"}


def test_template_mismatches_are_named(tmp_path):
    tree = {"a": {"w": np.zeros((2, 3), np.float32), "b": np.zeros((3,), np.float32)}}
    path = io.save_safetensors(tree, tmp_path / "t.safetensors")
    wrong_shape = {"a": {"w": np.zeros((3, 2), np.float32), "b": np.zeros((3,), np.float32)}}
    with pytest.raises(io.CheckpointKeyError, match=r"'a\.w' has shape \(2, 3\), the template \(3, 2\)"):
        io.load_safetensors(path, like=wrong_shape)
    wrong_dtype = {"a": {"w": np.zeros((2, 3), np.float16), "b": np.zeros((3,), np.float32)}}
    with pytest.raises(io.CheckpointKeyError, match=r"'a\.w' has dtype float32, the template float16"):
        io.load_safetensors(path, like=wrong_dtype)
    other_keys = {"a": {"w": np.zeros((2, 3), np.float32), "c": np.zeros((3,), np.float32)}}
    with pytest.raises(io.CheckpointKeyError, match=r"missing keys \['a\.c'\]; unexpected keys \['a\.b'\]"):
        io.load_safetensors(path, like=other_keys)


def test_torch_layout_checkpoint_converted_to_flax_kernels(tmp_path):
    """A PyTorch-layout MLP (fc1.weight is (out, in)) read as this package's dense_i.kernel (in, out)."""
    rng = np.random.default_rng(5)
    w1, b1 = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)
    w2, b2 = rng.normal(size=(3, 16)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)
    save_file(
        {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2},
        str(tmp_path / "torch.safetensors"),
    )
    mapping = io.KeyMapping.torch_linear(extra_rename=[(r"^fc(\d+)\.", lambda m: f"dense_{int(m[1]) - 1}.")])
    like = {
        "dense_0": {"kernel": np.zeros((8, 16), np.float32), "bias": np.zeros((16,), np.float32)},
        "dense_1": {"kernel": np.zeros((16, 3), np.float32), "bias": np.zeros((3,), np.float32)},
    }
    params = io.load_safetensors(tmp_path / "torch.safetensors", like=like, mapping=mapping)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    torch_out = np.maximum(x @ w1.T + b1, 0) @ w2.T + b2  # what torch's Linear layers compute
    flax_out = np.maximum(x @ params["dense_0"]["kernel"] + params["dense_0"]["bias"], 0)
    flax_out = flax_out @ params["dense_1"]["kernel"] + params["dense_1"]["bias"]
    np.testing.assert_allclose(flax_out, torch_out, rtol=1e-5, atol=1e-5)
    with pytest.raises(io.CheckpointKeyError, match="map both"):
        io.CheckpointReader(tmp_path / "torch.safetensors", mapping=io.KeyMapping(rename=[(r"\d", "")]))


def test_writes_never_overwrite_unless_asked_and_leave_no_temp_files(tmp_path):
    a, b = {"x": np.zeros(3, np.float32)}, {"x": np.ones(3, np.float32)}
    for target in (tmp_path / "f.safetensors", tmp_path / "folder"):
        io.save_safetensors(a, target)
        with pytest.raises(io.CheckpointError, match="exists"):
            io.save_safetensors(b, target)
        np.testing.assert_array_equal(io.load_safetensors(target)["x"], a["x"])
        io.save_safetensors(b, target, overwrite=True)
        np.testing.assert_array_equal(io.load_safetensors(target)["x"], b["x"])
    # A failing write (an unsupported dtype) leaves nothing behind.
    with pytest.raises(io.CheckpointError, match="complex128 cannot be stored"):
        io.save_safetensors({"z": np.zeros(2, np.complex128)}, tmp_path / "bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors", "folder"]


def test_streamed_writer_checks_order_shape_and_completeness(tmp_path):
    specs = {"a": ((2,), np.float32), "b": ((3,), np.int8)}
    w = io.ShardedWriter(tmp_path, specs)
    with pytest.raises(io.CheckpointError, match="got 'b', expected 'a'"):
        w.write("b", np.zeros(3, np.int8))
    with pytest.raises(io.CheckpointError, match=r"'a' is float64\[2\], declared float32\[2\]"):
        w.write("a", np.zeros(2))
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(io.CheckpointError, match="'b' and later tensors were never written"):
        w.close()
    # The header is an 8-byte multiple (data aligned) and the rest is the data, nothing more.
    raw = (tmp_path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0


def test_missing_and_broken_checkpoints_say_what_is_wrong(tmp_path):
    with pytest.raises(io.CheckpointError, match="not found"):
        io.load_safetensors(tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(io.CheckpointError, match="not a readable safetensors file"):
        io.load_safetensors(tmp_path / "junk.safetensors")
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(io.CheckpointError, match="names shard gone.safetensors, which does not exist"):
        io.load_safetensors(tmp_path / "idx")
    with pytest.raises(io.CheckpointKeyError, match="contains '.'"):
        io.save_safetensors({"a.b": np.zeros(1)}, tmp_path / "dots.safetensors")


def test_parse_size():
    assert io.parse_size("2GB") == 2 * 10**9
    assert io.parse_size("1.5GiB") == int(1.5 * 2**30)
    assert io.parse_size("500mb") == 500 * 10**6
    assert io.parse_size(123) == 123
    with pytest.raises(ValueError, match="cannot read shard size"):
        io.parse_size("lots")


def test_positional_reads_match_the_package_reader_per_dtype(tmp_path):
    rng = np.random.default_rng(5)
    tensors = {
        "a": rng.normal(size=(7, 5)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(ml_dtypes.bfloat16),
        "c": np.arange(6, dtype=np.int64).reshape(2, 3),
        "empty": np.zeros((0, 4), np.float16),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))  # written by the package, read here by offsets
    with safe_open(str(path), framework="np") as ref, io.CheckpointReader(path) as reader:
        for k in tensors:
            want = ref.get_tensor(k)
            got = reader.get(k)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), k
            out = np.empty(want.shape, want.dtype)
            reader.read_into(k, out)
            assert out.tobytes() == want.tobytes(), k
        with pytest.raises(ValueError, match="C-contiguous"):
            reader.read_into("a", np.empty((5, 7), np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            reader.read_into("a", np.empty((7, 5), np.float64))


def test_a_truncated_file_is_an_error_not_garbage(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": np.ones((64,), np.float32)}, str(path))
    size = path.stat().st_size
    with io.CheckpointReader(path) as reader:
        with open(path, "r+b") as f:  # truncated after the header was read
            f.truncate(size - 16)
        with pytest.raises(io.CheckpointError, match="ends early"):
            reader.get("a")


def test_range_reads_equal_slices_of_the_flattened_tensor(tmp_path):
    rng = np.random.default_rng(6)
    tensors = {
        "a": rng.normal(size=(7, 5)).astype(np.float32),
        "b": rng.normal(size=(11,)).astype(ml_dtypes.bfloat16),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    with io.CheckpointReader(path) as reader:
        for k, v in tensors.items():
            flat = v.reshape(-1)
            for start, stop in [(0, flat.size), (0, 1), (3, 9), (flat.size - 2, flat.size)]:
                out = np.empty(stop - start, v.dtype)
                reader.read_range_into(k, start, out)
                assert out.tobytes() == flat[start:stop].tobytes(), (k, start, stop)
        with pytest.raises(ValueError, match="within the 35 elements"):
            reader.read_range_into("a", 30, np.empty(6, np.float32))
        with pytest.raises(ValueError, match="C-contiguous float32"):
            reader.read_range_into("a", 0, np.empty(3, np.float64))
    transposed = io.KeyMapping(transpose=[r"^a$"])
    with (
        io.CheckpointReader(path, mapping=transposed) as reader,
        pytest.raises(ValueError, match="transposes"),
    ):
        reader.read_range_into("a", 0, np.empty(3, np.float32))


def _write_with(tmp_path, name, specs, arrays, **kw) -> bytes:
    folder = tmp_path / name
    folder.mkdir()
    w = io.ShardedWriter(folder, specs, **kw)
    for k, a in arrays.items():
        if isinstance(a, list):
            w.write_parts(k, a)
        else:
            w.write(k, a)
    w.close()
    return (folder / "model.safetensors").read_bytes()


def test_direct_writes_and_pieces_give_the_same_bytes_as_buffered_writes(tmp_path, monkeypatch):
    # A small stage makes the direct writer flush many times, with keys across the flushes.
    monkeypatch.setattr(io.safetensors.DirectFile, "STAGE", 8192)
    rng = np.random.default_rng(7)
    arrays = {
        "a": rng.normal(size=(3, 1000)).astype(np.float32),  # 12 kB: across stage flushes
        "b": _array(rng, (5,), ml_dtypes.bfloat16),  # 10 bytes: the file's size is no block multiple
        "c": rng.normal(size=(4099,)).astype(np.float64),
    }
    specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}
    buffered = _write_with(tmp_path, "buffered", specs, arrays)
    direct = _write_with(tmp_path, "direct", specs, arrays, direct=True)
    assert direct == buffered and len(direct) % 4096 != 0
    pieces = {k: [v.reshape(-1)[:7], v.reshape(-1)[7:]] for k, v in arrays.items()}
    assert _write_with(tmp_path, "pieces", specs, pieces, direct=True) == buffered
    _assert_bits_equal(arrays, io.load_safetensors(tmp_path / "direct"))


@pytest.mark.parametrize("refuses", ["open", "write"])
def test_direct_writer_falls_back_where_the_file_system_refuses_o_direct(tmp_path, monkeypatch, refuses):
    import errno
    import os

    direct_flag = getattr(os, "O_DIRECT", 0)
    real_open, real_write = os.open, os.write
    direct_fds, refused = set(), []

    # A file system that refuses O_DIRECT at open (tmpfs), or takes the flag and then refuses
    # the writes; the flag itself is never passed on, so this runs on any file system.
    def fake_open(path, flags, *args):
        if flags & direct_flag and refuses == "open":
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags & ~direct_flag, *args)
        (direct_fds.add if flags & direct_flag else direct_fds.discard)(fd)  # fds are reused
        return fd

    def fake_write(fd, data):
        if fd in direct_fds:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    rng = np.random.default_rng(8)
    arrays = {"a": rng.normal(size=(5000,)).astype(np.float32), "b": np.arange(3, dtype=np.int8)}
    specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}
    monkeypatch.setattr(io.safetensors.DirectFile, "STAGE", 8192)
    monkeypatch.setattr(os, "O_DIRECT", direct_flag or 0o40000, raising=False)
    direct_flag = os.O_DIRECT
    with monkeypatch.context() as m:
        m.setattr(os, "open", fake_open)
        m.setattr(os, "write", fake_write)
        got = _write_with(tmp_path, "direct", specs, arrays, direct=True)
    assert refused, "O_DIRECT was never tried"
    assert got == _write_with(tmp_path, "buffered", specs, arrays)


def test_pieces_are_checked_against_the_declared_tensor(tmp_path):
    w = io.ShardedWriter(tmp_path, {"a": ((2, 3), np.float32)})
    with pytest.raises(io.CheckpointError, match=r"'a' is float32\[2, 3\], got 2 pieces of 5 values"):
        w.write_parts("a", [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    with pytest.raises(io.CheckpointError, match="one float64"):
        w.write_parts("a", [np.zeros(6)])
    w.write_parts("a", [np.zeros(4, np.float32), np.ones(2, np.float32)])
    w.close()
    np.testing.assert_array_equal(io.load_safetensors(tmp_path)["a"], [[0, 0, 0], [0, 1, 1]])


def test_direct_writer_reports_a_full_disk_instead_of_falling_back(tmp_path, monkeypatch):
    import errno
    import os

    real_write = os.write
    direct_flag = getattr(os, "O_DIRECT", 0) or 0o40000
    monkeypatch.setattr(os, "O_DIRECT", direct_flag, raising=False)
    real_open = os.open
    opened = []

    def fake_open(path, flags, *a):
        opened.append(flags & direct_flag)
        return real_open(path, flags & ~direct_flag, *a)

    monkeypatch.setattr(os, "open", fake_open)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    w = io.ShardedWriter(tmp_path, {"a": ((3,), np.float32)}, direct=True)
    w.write("a", np.ones(3, np.float32))
    with pytest.raises(OSError, match="No space left"):
        w.close()
    monkeypatch.setattr(os, "write", real_write)
    assert opened == [direct_flag]  # opened once, direct: no silent switch to buffered writes


@pytest.mark.parametrize("name", ["one.safetensors", "folder"])
def test_scalars_round_trip_as_scalars_and_the_same_tree_gives_the_same_bytes(tmp_path, name):
    tree = {"step": np.int32(7), "count": 3, "w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    meta = {"z": "1", "a": "2"}
    first = io.save_safetensors(tree, tmp_path / "a" / name, metadata=meta)
    second = io.save_safetensors(tree, tmp_path / "b" / name, metadata=dict(reversed(meta.items())))
    files = sorted(p.relative_to(first) for p in first.rglob("*")) if first.is_dir() else [None]
    for rel in files:
        a, b = (first / rel, second / rel) if rel is not None else (first, second)
        assert a.read_bytes() == b.read_bytes()
    back = io.load_safetensors(first, like=tree)
    assert back["step"].shape == () and back["step"] == 7 and back["count"].shape == ()
    with io.CheckpointReader(first) as r:
        assert r.metadata == {"a": "2", "format": "pt", "z": "1"}  # Hugging Face's loaders need "format"
