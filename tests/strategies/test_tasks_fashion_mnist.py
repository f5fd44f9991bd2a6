"""Fashion-MNIST task and IDX reader on tiny IDX files written by the test (no Debian package needed)."""

from __future__ import annotations

import gzip

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strategies.registry import resolve_task
from strategies.tasks import fashion_mnist as fm
from strategies.tasks.idx import IDXError, read_idx, write_idx


def _images(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    """Class c lights up row band c of the image (learnable), plus noise."""
    x = rng.integers(0, 60, size=(len(labels), 28, 28)).astype(np.uint8)
    for i, c in enumerate(labels):
        x[i, 2 * c + 4 : 2 * c + 6, :] = 250
    return x


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory):
    """A small Fashion-MNIST-shaped folder: 600 train, 100 test images; train gzipped, test plain."""
    folder = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(0)
    train_y = np.tile(np.arange(10, dtype=np.uint8), 60)
    test_y = np.tile(np.arange(10, dtype=np.uint8), 10)
    write_idx(folder / "train-images-idx3-ubyte.gz", _images(rng, train_y))
    write_idx(folder / "train-labels-idx1-ubyte.gz", train_y)
    write_idx(folder / "t10k-images-idx3-ubyte", _images(rng, test_y))
    write_idx(folder / "t10k-labels-idx1-ubyte", test_y)
    return folder


def test_idx_reader_matches_the_bytes_it_was_given(tmp_path):
    rng = np.random.default_rng(1)
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64):
        a = (rng.normal(size=(3, 4, 5)) * 50).astype(dtype)
        for name in ("a.idx", "a.idx.gz"):
            back = read_idx(write_idx(tmp_path / name, a))
            assert back.dtype == np.dtype(dtype) and back.shape == a.shape
            np.testing.assert_array_equal(back, a)
    # Hand-made header, independent of write_idx: magic 0x00000801, 3 labels.
    raw = bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9])
    (tmp_path / "labels").write_bytes(raw)
    np.testing.assert_array_equal(read_idx(tmp_path / "labels"), [7, 8, 9])
    (tmp_path / "labels.gz").write_bytes(gzip.compress(raw))
    np.testing.assert_array_equal(read_idx(tmp_path / "labels.gz"), [7, 8, 9])
    # Big-endian int32 payload read as numbers, not bytes.
    (tmp_path / "i32").write_bytes(bytes([0, 0, 0x0C, 1, 0, 0, 0, 2]) + (258).to_bytes(4, "big") * 2)
    np.testing.assert_array_equal(read_idx(tmp_path / "i32"), [258, 258])


def test_idx_reader_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x1f\x00\x08\x01abcd")
    with pytest.raises(IDXError, match="not an IDX file"):
        read_idx(bad)
    bad.write_bytes(bytes([0, 0, 0x42, 1, 0, 0, 0, 1, 0]))
    with pytest.raises(IDXError, match="unknown IDX type code 0x42"):
        read_idx(bad)
    bad.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(IDXError, match=r"header says \(5,\) uint8 \(5 bytes\) but 2 bytes follow"):
        read_idx(bad)
    good = write_idx(tmp_path / "good", np.zeros((2, 3, 3), np.uint8))
    with pytest.raises(IDXError, match="holds uint8, expected int32"):
        read_idx(good, dtype=np.int32)
    with pytest.raises(IDXError, match=r"has shape \(2, 3, 3\), expected \(None, 28, 28\)"):
        read_idx(good, shape=(None, 28, 28))


def test_missing_files_name_the_package_and_the_paths(tmp_path, monkeypatch):
    with pytest.raises(fm.DataNotFoundError) as e:
        fm.find_files(tmp_path)
    text = str(e.value)
    assert "dataset-fashion-mnist" in text and "apt-get install" in text
    assert (
        str(tmp_path / "train-images-idx3-ubyte.gz") in text
        and str(tmp_path / "t10k-labels-idx1-ubyte") in text
    )
    monkeypatch.setenv(fm.ENV_VAR, str(tmp_path / "from_env"))
    assert fm.data_directory() == tmp_path / "from_env"
    assert fm.data_directory(tmp_path) == tmp_path  # the option wins over the variable


def test_splits_follow_the_node_protocol(idx_dir):
    task = resolve_task("fashion_mnist", {"data_dir": str(idx_dir), "heldout_size": 100})
    data = task.splits(4, seed=3, alpha=1.0)
    x, y, num_train = fm._load(str(idx_dir))
    assert num_train == 600 and x.dtype == np.uint8
    # Test = the official test file; held-out = 10 per class from the training file; nodes share the rest.
    np.testing.assert_array_equal(data.test["x"], read_idx(idx_dir / "t10k-images-idx3-ubyte"))
    np.testing.assert_array_equal(np.bincount(data.heldout["y"], minlength=10), np.full(10, 10))
    ids = data.meta["example_ids"]
    own = np.concatenate([ids[i, : data.train_count[i]] for i in range(4)])
    # A stratified tenth of the training rows is the public pool; the nodes share the rest.
    public = data.meta["general_ids"]
    assert data.general_pool == "public" and np.intersect1d(public, own).size == 0
    np.testing.assert_array_equal(
        np.bincount(y[public], minlength=10),
        np.round(0.1 * np.bincount(y[np.concatenate([own, public])], minlength=10)),
    )
    assert len(own) == len(np.unique(own)) == 500 - len(public) and own.max() < 600
    held_ids = {bytes(r) for r in data.heldout["x"].reshape(100, -1)}
    assert not held_ids & {bytes(x[i].reshape(-1)) for i in own}
    for i in range(4):
        c = data.train_count[i]
        np.testing.assert_array_equal(data.train["x"][i, :c], x[ids[i, :c]])
        np.testing.assert_array_equal(data.train["y"][i, :c], y[ids[i, :c]])
    assert data.group_names[0] == "t-shirt/top"
    # The same partition as digits' code path: Dirichlet over the training labels with the seed.
    again = task.splits(4, seed=3, alpha=1.0)
    np.testing.assert_array_equal(again.meta["example_ids"], ids)


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_models_learn_the_tiny_set(idx_dir, model):
    task = fm.FashionMNISTTask(
        model=model, hidden=(32,), channels=(2, 4), data_dir=str(idx_dir), heldout_size=100
    )
    data = task.splits(1)
    params = task.init(jax.random.key(0))
    rows = 200 if model == "mlp" else 50  # convolutions are slow on CPU: a smaller batch for the CNN
    batch = {"x": jnp.asarray(data.general["x"][:rows]), "y": jnp.asarray(data.general["y"][:rows])}
    assert jax.eval_shape(task.apply, params, batch["x"][:3]).shape == (3, 10)
    loss, metrics = jax.jit(task.loss), jax.jit(task.metrics)  # eager ops would each compile: slow
    start = float(loss(params, batch))

    @jax.jit
    def train(params):  # 25 full-batch gradient steps in one compiled loop (fast on a loaded machine)
        def step(p, _):
            g = jax.grad(task.loss)(p, batch)
            return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), None

        return jax.lax.scan(step, params, None, length=25)[0]

    params = train(params)
    test = {k: jnp.asarray(v) for k, v in data.test.items()}
    assert float(loss(params, batch)) < 0.5 * start
    assert float(metrics(params, test)["accuracy"]) > 0.9
    flipped = task.flip_labels(test)
    np.testing.assert_array_equal(flipped["y"], 9 - np.asarray(test["y"]))


def test_bad_options_are_named(idx_dir):
    with pytest.raises(ValueError, match="model must be 'mlp' or 'cnn'"):
        fm.FashionMNISTTask(model="resnet")
    with pytest.raises(ValueError, match="takes no option"):
        resolve_task("fashion_mnist", {"depth": 3})
