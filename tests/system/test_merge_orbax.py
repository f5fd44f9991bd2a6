"""``meta-consensus merge`` on orbax checkpoints of this package, written by :class:`RunCheckpoints`.

The consensus of each checkpoint is read leaf by leaf (``meta_consensus.checkpoint.TreeReader``)
under the dotted keys ``consensus.io.save_safetensors`` gives the same tree; the merge equals the
in-memory library merge, numpy's float64 median, and the same merge of safetensors copies (bit for
bit), with orbax and safetensors inputs mixed. Damaged or foreign folders are one-line errors.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import consensus
from consensus import io
from meta_consensus.checkpoint import RunCheckpoints, TreeReader, find_step_directory
from meta_consensus.cli import main
from meta_consensus.config import Config
from meta_consensus.coordinator import CoordinatorState
from strategies.trainer import TrainState

N = 5


def _models(seed: int = 0) -> list[dict]:
    """N consensus trees: dict and list nodes, float32 / bfloat16 leaves, an int leaf equal in all."""
    rng = np.random.default_rng(seed)
    models = []
    for i in range(N):
        spread = 5.0 if i == N - 1 else 0.1  # the last one is an outlier
        models.append(
            {
                "Dense_0": {
                    "kernel": (1 + spread * rng.normal(size=(6, 4))).astype(np.float32),
                    "bias": (spread * rng.normal(size=(4,))).astype(ml_dtypes.bfloat16),
                },
                "blocks": [
                    {"w": (spread * rng.normal(size=(4, 3))).astype(np.float32)},
                    {"w": (spread * rng.normal(size=(3,))).astype(np.float32)},
                ],
                "count": np.array([3, 5], np.int32),
            }
        )
    return models


def _state(consensus_tree: dict, round_: int) -> CoordinatorState:
    """A coordinator state around ``consensus_tree`` with nodes and a FedAvg baseline, as a run has."""
    tree = jax.tree.map(jnp.asarray, consensus_tree)
    nodes = TrainState(
        jax.tree.map(lambda x: jnp.stack([x, x]), tree),
        {"mu": jnp.zeros((2, 3))},
        jnp.zeros((2, 2), jnp.uint32),
        jnp.zeros((2,), jnp.int32),
    )
    fedavg = jax.tree.map(lambda x: x + jnp.ones((), x.dtype) if x.dtype != jnp.int32 else x, tree)
    return CoordinatorState(
        round=round_,
        consensus=tree,
        nodes=nodes,
        aggregator=(),
        fedavg=fedavg,
        fedavg_nodes=None,
        ledger=None,
        key=jnp.zeros((2,), jnp.uint32),
    )


def _write_orbax(run_dir, tree: dict, rounds=(3,)) -> None:
    """Checkpoints of a run through the package's own writer; the last round holds ``tree``."""
    ckpt = RunCheckpoints(run_dir, Config().replace(keep_checkpoints=len(rounds)))
    try:
        for r in rounds:
            last = r == rounds[-1]
            ckpt.save(_state(tree if last else jax.tree.map(np.zeros_like, tree), r), [])
    finally:
        ckpt.close()


def _inputs(tmp_path, models) -> tuple[list[str], list[str]]:
    """Each model as an orbax checkpoint (step, checkpoints and run folders) and as a safetensors copy."""
    orbax, st = [], []
    for i, m in enumerate(models):
        run = tmp_path / f"run{i}"
        _write_orbax(run, m, rounds=(1, 4) if i == 1 else (3,))
        orbax.append(str([run / "checkpoints" / "3", run / "checkpoints", run][i % 3]))
        st.append(str(io.save_safetensors(m, tmp_path / f"copy{i}.safetensors")))
    return orbax, st


def _merge(argv, out) -> dict[str, np.ndarray]:
    assert main(["merge", *argv, "--quiet", "--out", str(out)]) == 0
    return io.flatten(io.load_safetensors(out))


def _library(rule, models, params=None) -> dict[str, np.ndarray]:
    f32 = [jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), m) for m in models]
    merged, _ = rule.update(consensus.stack(f32), rule.init(f32[0]), params)
    return io.flatten(jax.tree.map(np.asarray, merged))


def test_tree_reader_keys_dtypes_and_values_are_the_safetensors_ones(tmp_path):
    (m,) = _models()[:1]
    _write_orbax(tmp_path / "run", m, rounds=(1, 4))
    with TreeReader(tmp_path / "run") as r:
        assert r.step_directory.name == "4"  # a run folder: its latest round
        flat = io.flatten(m)
        assert list(r.specs) == list(flat)  # same keys, same order as save_safetensors writes
        assert list(r.specs) == ["Dense_0.bias", "Dense_0.kernel", "blocks.0.w", "blocks.1.w", "count"]
        for k, v in flat.items():
            assert r.specs[k] == (v.shape, v.dtype), k
            got = np.empty(v.shape, v.dtype)
            r.read_into(k, got)
            np.testing.assert_array_equal(got, v, err_msg=k)
            assert got.dtype == v.dtype
        assert r.restores == 1  # the whole (small) tree in one group
    # one leaf per restore: dict paths through partial_restore, list paths through placeholders;
    # out of order too
    with TreeReader(tmp_path / "run", group_bytes=1) as r:
        for k in reversed(list(flat)):
            np.testing.assert_array_equal(r.get(k), flat[k], err_msg=k)
        assert r.restores == len(flat)
    with TreeReader(tmp_path / "run", group_bytes=4 * 24 + 2 * 4) as r:  # kernel + bias in one group
        np.testing.assert_array_equal(r.get("Dense_0.kernel"), flat["Dense_0.kernel"])  # its own group
        for k in flat:
            np.testing.assert_array_equal(r.get(k), flat[k], err_msg=k)
        assert r.restores == 1 + 2  # kernel; then bias + kernel, blocks.0.w + blocks.1.w + count
    with TreeReader(tmp_path / "run" / "checkpoints" / "1") as r:  # a step folder: that round
        np.testing.assert_array_equal(r.get("Dense_0.kernel"), np.zeros((6, 4), np.float32))
    with TreeReader(tmp_path / "run", tree="fedavg") as r:
        np.testing.assert_array_equal(r.get("Dense_0.kernel"), m["Dense_0"]["kernel"] + 1)
    assert find_step_directory(tmp_path) is None


@pytest.mark.parametrize(
    ("argv", "rule", "tol"),
    [
        (["--method", "median"], consensus.median(), 0),
        (["--method", "trimmed_mean", "-f", "1"], consensus.trimmed_mean(1), 1e-6),
        pytest.param(["--method", "krum", "-f", "1"], consensus.krum(1), 1e-6, marks=pytest.mark.slow),
    ],
    ids=["median", "trimmed_mean", "krum"],
)
def test_orbax_inputs_equal_the_library_and_the_safetensors_copies(tmp_path, argv, rule, tol):
    models = _models()
    orbax, st = _inputs(tmp_path, models)
    got = _merge([*argv, *orbax], tmp_path / "from_orbax")
    from_st = _merge([*argv, *st], tmp_path / "from_safetensors")
    alternate = [orbax[i] if i % 2 == 0 else st[i] for i in range(N)]
    mixed = _merge([*argv, *alternate], tmp_path / "mixed")
    want = _library(rule, models)
    assert list(got) == list(from_st) == list(mixed)
    for k, v in got.items():
        # bit for bit the same as from safetensors copies, orbax and safetensors mixed or not
        assert v.dtype == from_st[k].dtype == mixed[k].dtype == io.flatten(models[0])[k].dtype, k
        np.testing.assert_array_equal(v, from_st[k], err_msg=k)
        np.testing.assert_array_equal(v, mixed[k], err_msg=k)
        if k == "count":
            np.testing.assert_array_equal(v, models[0]["count"])  # copied, equal in every input
            continue
        expected = want[k].astype(v.dtype)  # merged in float32, cast back to the input's dtype
        np.testing.assert_allclose(v.astype(np.float32), expected.astype(np.float32), rtol=tol, atol=tol)
        if argv[1] == "median":  # an independent reference: numpy, float64
            stack = np.stack([io.flatten(m)[k].astype(np.float64) for m in models])
            np.testing.assert_array_equal(v, np.median(stack, 0).astype(np.float32).astype(v.dtype))
    report = json.loads((tmp_path / "from_orbax" / "merge_report.json").read_text())
    assert report["inputs"] == orbax
    assert report["orbax_steps"][orbax[1]].endswith("checkpoints/4")  # the latest round of input 1
    assert set(report["orbax_steps"]) == set(orbax)


def test_task_arithmetic_over_an_orbax_base_with_mixed_inputs(tmp_path):
    models = _models(1)
    rng = np.random.default_rng(9)
    base = jax.tree.map(lambda x: x, models[0])
    base["Dense_0"] = {
        "kernel": (models[0]["Dense_0"]["kernel"] + 0.05 * rng.normal(size=(6, 4))).astype(np.float32),
        "bias": models[0]["Dense_0"]["bias"],
    }
    orbax, st = _inputs(tmp_path, models)
    _write_orbax(tmp_path / "base_run", base)
    io.save_safetensors(base, tmp_path / "base.safetensors")
    argv = ["--method", "task_arithmetic", "--set", "method.scale=0.5"]
    got = _merge([*argv, "--base", str(tmp_path / "base_run"), orbax[0], st[1], *orbax[2:]], tmp_path / "a")
    from_st = _merge([*argv, "--base", str(tmp_path / "base.safetensors"), *st], tmp_path / "b")
    kernel = base["Dense_0"]["kernel"].astype(np.float64)
    want = kernel + 0.5 * sum(m["Dense_0"]["kernel"].astype(np.float64) - kernel for m in models)
    np.testing.assert_allclose(got["Dense_0.kernel"], want, rtol=1e-5, atol=1e-5)
    for k, v in got.items():
        np.testing.assert_array_equal(v, from_st[k], err_msg=k)


def _one_line_error(capsys, argv, pattern, tmp_path, before):
    assert main(["merge", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert pattern in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temporary left behind


def test_bad_orbax_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch):
    models = _models(2)
    orbax, st = _inputs(tmp_path, models)
    step = find_step_directory(orbax[0])
    # damaged copies of input 0: the metadata file gone; every data file cut short
    no_meta = tmp_path / "no_meta"
    _write_orbax(no_meta, models[0])
    (no_meta / "checkpoints" / "3" / "arrays" / "_METADATA").unlink()
    cut = tmp_path / "cut"
    _write_orbax(cut, models[0])
    for f in (cut / "checkpoints" / "3" / "arrays").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:10])
    (tmp_path / "empty").mkdir()
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "notes.txt").write_text("not a checkpoint")
    other = dict(models[0], extra={"w": np.zeros(2, np.float32)})
    _write_orbax(tmp_path / "other", other)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = ["--quiet", "--out", str(tmp_path / "new")]
    cases = [
        (["--method", "median", *out, *orbax[:2], str(tmp_path / "empty")], "empty: not a checkpoint"),
        (["--method", "median", *out, *orbax[:2], str(tmp_path / "stray")], "no orbax checkpoint"),
        (["--method", "median", *out, *orbax[:2], str(no_meta)], "cannot read the checkpoint's metadata"),
        (["--method", "median", *out, *orbax[:2], str(cut)], "cannot read the checkpoint's metadata"),
        (
            ["--method", "median", *out, st[0], orbax[1], str(tmp_path / "other")],
            f"{tmp_path / 'other'} does not have the keys of {st[0]}: has extra ['extra.w']",
        ),
        (["--method", "median", *out, "--base", str(tmp_path / "empty"), *orbax], "not a checkpoint"),
    ]
    for argv, pattern in cases:
        _one_line_error(capsys, argv, pattern, tmp_path, before)

    # A read that fails half-way through the merge (after the output folder was started): one
    # line, exit 2, and the temporary output removed.
    real = TreeReader.get

    def failing(self, key):
        if key == "blocks.1.w" and self.step_directory == step:
            raise io.CheckpointError(f"{step}: cannot restore consensus.{key} (simulated)")
        return real(self, key)

    monkeypatch.setattr(TreeReader, "get", failing)
    _one_line_error(
        capsys, ["--method", "median", *out, *orbax], "cannot restore consensus.blocks.1.w", tmp_path, before
    )


def test_a_failed_orbax_restore_is_a_checkpoint_error(tmp_path):
    (m,) = _models()[:1]
    _write_orbax(tmp_path / "run", m)
    with TreeReader(tmp_path / "run") as r:
        for f in (tmp_path / "run" / "checkpoints" / "3" / "arrays").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(b"")  # the data goes after the metadata was read
        with pytest.raises(io.CheckpointError, match=r"cannot restore consensus\.Dense_0\.kernel"):
            r.get("Dense_0.kernel")
