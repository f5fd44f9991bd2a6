"""Fashion-MNIST (Xiao, Rasul and Vollgraf 2017): 70,000 28x28 grey images of 10 clothing classes.

Read from the original IDX files (``train-images-idx3-ubyte.gz`` etc., gzip or
not, see :mod:`strategies.tasks.idx`); nothing is ever downloaded. Where the
files are looked for, first match wins:

1. the task option ``data_dir`` (only there when given);
2. the environment variable ``META_CONSENSUS_FASHION_MNIST`` (only there when set);
3. ``/usr/share/datasets/fashion-mnist/``, where Debian's package
   ``dataset-fashion-mnist`` puts them (``apt-get install dataset-fashion-mnist``,
   or ``make data``).

Splits: the official 10,000 test images are the test split; ``heldout_size``
images of the official 60,000 training images (stratified, ``split_seed``) are
the held-out split, the rest the training split; a stratified
``public_fraction`` (default 0.1) of it is the public pool and the
Dirichlet(alpha) partition shares the rest over the nodes (the node protocol of
:mod:`strategies.tasks.classification`, the same as digits).

Pixels are stored as uint8 (a quarter of the memory of float32 on every node
shard) and scaled in :meth:`FashionMNISTTask.apply` to ``(x / 255 - 0.2860) /
0.3530`` (the training set's mean and standard deviation).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strategies.tasks.base import (
    DEFAULT_PUBLIC_FRACTION,
    GENERAL_POOLS,
    TASKS,
    Array,
    PyTree,
    TaskData,
    param_dtype,
    split_module,
)
from strategies.tasks.classification import ClassifierMethods, classification_splits
from strategies.tasks.digits import MLP, mlp_dense_taps
from strategies.tasks.idx import read_idx

NUM_CLASSES = 10
SIDE = 28
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
ENV_VAR = "META_CONSENSUS_FASHION_MNIST"
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_PACKAGE = "dataset-fashion-mnist"
FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
CLASS_NAMES = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)


class DataNotFoundError(FileNotFoundError):
    """The IDX files are not where the task looked."""


def data_directory(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder the files are read from (see the module docstring for the order).

    Args:
      data_dir: an explicit folder (default: the environment variable, else Debian's folder).

    Returns:
      The folder.
    """
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else DEBIAN_DIR


def find_files(data_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """The four IDX files (``name.gz`` or ``name``).

    Args:
      data_dir: the folder (see :func:`data_directory`).

    Returns:
      The path of each file by role (``train_x``, ``train_y``, ``test_x``, ``test_y``).

    Raises:
      DataNotFoundError: listing every path tried and the Debian package.
    """
    folder = data_directory(data_dir)
    found, tried = {}, []
    for role, name in FILES.items():
        for candidate in (folder / f"{name}.gz", folder / name):
            tried.append(str(candidate))
            if candidate.is_file():
                found[role] = candidate
                break
    if len(found) < len(FILES):
        missing = [FILES[r] for r in FILES if r not in found]
        raise DataNotFoundError(
            f"Fashion-MNIST: {missing} not found; tried {tried}. The files come from Debian's package "
            f"{DEBIAN_PACKAGE} (apt-get install {DEBIAN_PACKAGE}, or make data; files under {DEBIAN_DIR}/); "
            f"elsewhere put the original IDX files in a folder and pass data_dir=... or set {ENV_VAR}."
        )
    return found


@functools.cache
def _load(folder: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(x uint8 (N, 28, 28), y int32 (N,), number of official training rows); train rows first."""
    files = find_files(folder)
    train_x = read_idx(files["train_x"], dtype=np.uint8, shape=(None, SIDE, SIDE))
    train_y = read_idx(files["train_y"], dtype=np.uint8, shape=(None,))
    test_x = read_idx(files["test_x"], dtype=np.uint8, shape=(None, SIDE, SIDE))
    test_y = read_idx(files["test_y"], dtype=np.uint8, shape=(None,))
    for xs, ys, what in ((train_x, train_y, "train"), (test_x, test_y, "t10k")):
        if len(xs) != len(ys):
            raise ValueError(f"Fashion-MNIST {what}: {len(xs)} images but {len(ys)} labels ({folder})")
        if ys.size and ys.max() >= NUM_CLASSES:
            raise ValueError(f"Fashion-MNIST {what}: label {int(ys.max())} is not a class 0..9 ({folder})")
    x = np.concatenate([train_x, test_x])
    y = np.concatenate([train_y, test_y]).astype(np.int32)
    return x, y, len(train_y)


class CNN(nnx.Module):
    """Two 3x3 convolutions (ReLU, 2x2 average pooling) and a linear head: 28x28x1 -> 10 logits."""

    def __init__(self, channels: tuple[int, int] = (16, 32), *, rngs: nnx.Rngs):
        def conv(a: int, b: int) -> nnx.Conv:
            kernel = nnx.with_partitioning(
                nnx.initializers.lecun_normal(), (None, None, None, "mlp"), eager_sharding=False
            )
            bias = nnx.with_partitioning(nnx.initializers.zeros, ("mlp",), eager_sharding=False)
            return nnx.Conv(a, b, (3, 3), padding="SAME", kernel_init=kernel, bias_init=bias, rngs=rngs)

        self.conv_0 = conv(1, channels[0])
        self.conv_1 = conv(channels[0], channels[1])
        flat = (SIDE // 4) * (SIDE // 4) * channels[1]
        kernel = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("mlp", "classes"), eager_sharding=False
        )
        bias = nnx.with_partitioning(nnx.initializers.zeros, ("classes",), eager_sharding=False)
        self.head = nnx.Linear(flat, NUM_CLASSES, kernel_init=kernel, bias_init=bias, rngs=rngs)

    def __call__(self, x: Array, *, dropout: float = 0.0, key: Array | None = None) -> Array:
        """The logits of a batch of images.

        Args:
          x: (B, 28, 28, 1) images.
          dropout: unused (no dropout in the CNN).
          key: unused.

        Returns:
          (B, 10) logits.
        """
        del dropout, key  # no dropout in the CNN (the option applies to the MLP)
        for conv in (self.conv_0, self.conv_1):
            x = jax.nn.relu(conv(x))
            b, h, w, c = x.shape  # 2x2 average pooling as a reshape (exact in any float dtype)
            x = jnp.mean(x.reshape(b, h // 2, 2, w // 2, 2, c), axis=(2, 4))
        return self.head(x.reshape(x.shape[0], -1))


@dataclasses.dataclass(frozen=True)
class FashionMNISTTask(ClassifierMethods):
    """The Fashion-MNIST classification task, an MLP or a small CNN.

    Args:
      model: ``"mlp"`` (784 -> hidden -> 10) or ``"cnn"`` (see :class:`CNN`).
      hidden: hidden widths of the MLP.
      channels: channels of the CNN's two convolutions.
      dropout: MLP dropout rate in training (0 disables it).
      heldout_size: images of the official training set kept for model selection.
      split_seed: seed of the held-out draw (fixed, so numbers compare across partition seeds).
      dominant_mass: share of a node's shard its specialized classes cover.
      data_dir: folder of the IDX files (see the module docstring for the default).
      limit: use only the first ``limit`` official training and test images each
        (quick runs and tests; None = all).
      public_fraction: stratified share of the training split reserved as the public pool
        (fixed by ``split_seed``), apart from every node's shard.
      general_pool: ``"public"`` (the public pool) or ``"union"`` (the public pool and every
        node's shard: centralised data).

    Raises:
      ValueError: for an unknown ``model`` or ``general_pool``, a dropout or ``public_fraction``
        outside [0, 1), a ``heldout_size`` below 10, or a ``limit`` that leaves no training image.
    """

    model: str = "mlp"
    hidden: tuple[int, ...] = (256,)
    channels: tuple[int, int] = (16, 32)
    dropout: float = 0.0
    heldout_size: int = 5000
    split_seed: int = 0
    dominant_mass: float = 0.8
    data_dir: str | None = None
    limit: int | None = None
    public_fraction: float = DEFAULT_PUBLIC_FRACTION
    general_pool: str = "public"
    name: str = "fashion_mnist"

    def __post_init__(self):
        if self.model not in ("mlp", "cnn"):
            raise ValueError(f"fashion_mnist: model must be 'mlp' or 'cnn', got {self.model!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"fashion_mnist: dropout must be in [0, 1), got {self.dropout}")
        if self.heldout_size < NUM_CLASSES:
            raise ValueError(f"fashion_mnist: heldout_size must be >= {NUM_CLASSES}, got {self.heldout_size}")
        if self.limit is not None and self.limit <= self.heldout_size:
            raise ValueError(f"fashion_mnist: limit={self.limit} leaves no training images past heldout_size")
        if not 0.0 <= self.public_fraction < 1.0:
            raise ValueError(f"fashion_mnist: public_fraction must be in [0, 1), got {self.public_fraction}")
        if self.general_pool not in GENERAL_POOLS:
            raise ValueError(
                f"fashion_mnist: general_pool must be one of {list(GENERAL_POOLS)}, got {self.general_pool!r}"
            )
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))

    def _module(self, rngs: nnx.Rngs) -> nnx.Module:
        if self.model == "cnn":
            return CNN(self.channels, rngs=rngs)
        return MLP((SIDE * SIDE, *self.hidden, NUM_CLASSES), rngs=rngs)

    @functools.cached_property
    def _graphdef(self) -> Any:
        return nnx.graphdef(nnx.eval_shape(lambda: self._module(nnx.Rngs(0))))

    def init(self, key: Array) -> PyTree:
        """Fresh float32 params (a nested dict of arrays).

        Args:
          key: a JAX PRNG key.

        Returns:
          The parameters.
        """
        _, params, _ = split_module(self._module(nnx.Rngs(params=key)))
        return params

    def logical_axes(self, params: PyTree | None = None) -> PyTree:
        """Logical axis names per leaf (from the model's ``nnx.with_partitioning`` metadata).

        Args:
          params: unused (the axes follow from the architecture).

        Returns:
          A tree like the parameters with a tuple of names per leaf.
        """
        _, _, axes = split_module(nnx.eval_shape(lambda: self._module(nnx.Rngs(0))))
        return axes

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """Logits (B, 10) in the params' dtype from uint8 (or already scaled float) images (B, 28, 28).

        Args:
          params: the parameters.
          inputs: (B, 28, 28) images.
          train: training mode (MLP dropout on, when configured).
          key: the dropout key in training mode.

        Returns:
          (B, 10) logits.
        """
        x = self._features(params, inputs)
        model = nnx.merge(self._graphdef, params)
        return model(x, dropout=self.dropout if train else 0.0, key=key)

    def _features(self, params: PyTree, inputs: Array) -> Array:
        dtype = param_dtype(params)
        x = inputs.astype(jnp.float32)
        if jnp.issubdtype(inputs.dtype, jnp.integer):
            x = x / 255.0
        x = ((x - PIXEL_MEAN) / PIXEL_STD).astype(dtype)
        return x.reshape(x.shape[0], SIDE, SIDE, 1) if self.model == "cnn" else x.reshape(x.shape[0], -1)

    def dp_dense_taps(self) -> Any:
        """Dense-layer taps for the fast DP-SGD path (ghost clipping): the MLP without dropout, else None.

        Returns:
          :class:`strategies.dpsgd.DenseTaps`, or None.
        """
        if self.model != "mlp" or self.dropout > 0.0:
            return None
        return mlp_dense_taps((SIDE * SIDE, *self.hidden, NUM_CLASSES), self._graphdef, self._features)

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """The official test split, stratified held-out and public slices, Dirichlet(alpha) shards.

        Args:
          num_nodes: the number of nodes over all processes.
          seed: the partition's seed.
          alpha: the Dirichlet concentration of the non-IID partition.
          process_index: this process's index.
          process_count: the number of processes.

        Returns:
          The splits for this process's hosted nodes.

        Raises:
          DataNotFoundError: when the IDX files are not found.
          IDXError: for a file that is not the IDX array expected.
          ValueError: for image and label counts that differ, or a label that is not a class.
        """
        x, y, num_train = _load(str(data_directory(self.data_dir)))
        train_rows = np.arange(num_train)
        test = np.arange(num_train, len(y))
        if self.limit is not None:
            train_rows, test = train_rows[: self.limit], test[: self.limit]
        rng = np.random.default_rng(self.split_seed)
        # Stratified held-out draw: the same share of every class.
        per_class = [rng.permutation(train_rows[y[train_rows] == c]) for c in range(NUM_CLASSES)]
        share = self.heldout_size / len(train_rows)
        heldout = np.sort(np.concatenate([p[: int(round(share * len(p)))] for p in per_class]))
        train = np.setdiff1d(train_rows, heldout)
        return classification_splits(
            x,
            y,
            train=train,
            heldout=heldout,
            test=test,
            num_nodes=num_nodes,
            num_classes=NUM_CLASSES,
            seed=seed,
            alpha=alpha,
            dominant_mass=self.dominant_mass,
            process_index=process_index,
            process_count=process_count,
            group_names=CLASS_NAMES,
            public_fraction=self.public_fraction,
            general_pool=self.general_pool,
            public_seed=self.split_seed + 2,
        )


@TASKS.declare("fashion_mnist")
def fashion_mnist(
    model: str = "mlp",
    hidden: tuple[int, ...] = (256,),
    channels: tuple[int, int] = (16, 32),
    data_dir: str | None = None,
    heldout_size: int = 5000,
    limit: int | None = None,
) -> FashionMNISTTask:
    """Fashion-MNIST (70,000 28x28 images) from its IDX files, an MLP or a small CNN."""
    return FashionMNISTTask(
        model=model,
        hidden=tuple(hidden),
        channels=cast("tuple[int, int]", tuple(channels)),  # a config's list, as the tuple it holds
        data_dir=data_dir,
        heldout_size=heldout_size,
        limit=limit,
    )
