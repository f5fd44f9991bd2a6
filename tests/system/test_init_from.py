"""A run starts from a safetensors checkpoint (``init_from``, ``--init``), ends in ``consensus.safetensors``.

The file a run writes is read back bit for bit (keys, dtypes, values) against the
consensus ``train`` returned; a run started from it with no rounds hands the same
bits back; a checkpoint that does not fit the task (a missing key, a wrong shape
or dtype, no file) is one line on stderr, exit 2, and no run directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from system_helpers import SMALL

from consensus import io
from meta_consensus import MetaConsensus, cli, config

# The cheapest whole run: one round of plain local training, no attacker, no DP.
BASE = [
    *SMALL,
    "rounds=1",
    "nodes.count=4",
    "nodes.strategies=local",
    "nodes.local_steps=2",
    "byzantine.nodes=[]",
    "vote.rule=median",
    "vote.num_byzantine=0",
    "weights.objective=uniform",
    "dp.enabled=false",
    "baseline_fedavg=false",
]


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _leaves(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in io.flatten(tree).items()}


def _assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].tobytes() == want[k].tobytes(), k


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One round through the API: the run directory and the consensus ``train`` returned."""
    out = tmp_path_factory.mktemp("runs")
    cfg = config.load(None, [*BASE, f"output_dir={out}", "name=first"])
    result = MetaConsensus(cfg, progress=False).train()
    return cfg.run_dir, result


@pytest.mark.slow
def test_run_writes_its_consensus_as_safetensors_bit_exact(finished):
    run_dir, result = finished
    path = run_dir / "consensus.safetensors"
    assert path.is_file()
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("consensus")) == [path.name]
    _assert_bit_exact(
        _leaves(io.load_safetensors(path, like=result.consensus_params)), _leaves(result.consensus_params)
    )
    with safe_open(str(path), framework="np") as f:  # the reference reader, independent of consensus.io
        raw = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        meta = f.metadata()
    assert sorted(raw) == sorted(_leaves(result.consensus_params))
    _assert_bit_exact({k: raw[k] for k in _leaves(result.consensus_params)}, _leaves(result.consensus_params))
    assert meta["name"] == "first" and meta["round"] == "1"
    assert (run_dir / "checkpoints").is_dir()  # beside the orbax checkpoints


def test_init_from_starts_from_the_file_bit_exact(finished, tmp_path):
    run_dir, result = finished
    source = run_dir / "consensus.safetensors"
    cfg = config.load(None, [*BASE, f"output_dir={tmp_path}", "name=again", f"init_from='{source}'"])
    again = MetaConsensus(cfg, progress=False).train(max_rounds=0)  # no round: the consensus is the start
    _assert_bit_exact(_leaves(again.consensus_params), _leaves(result.consensus_params))
    _assert_bit_exact(
        _leaves(io.load_safetensors(cfg.run_dir / "consensus.safetensors")), _leaves(result.consensus_params)
    )
    # The task's own init is something else, so the file really was used.
    fresh = MetaConsensus(cfg.replace(init_from=None, name="fresh"), progress=False).train(max_rounds=0)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(fresh.consensus_params), jax.tree.leaves(again.consensus_params), strict=True
        )
    )


@pytest.mark.slow
def test_cli_init_runs_from_the_file_and_records_it(finished, tmp_path, capsys):
    run_dir, _ = finished
    source = run_dir / "consensus.safetensors"
    argv = ["run", "--quiet", "--init", str(source), *_sets(*BASE, f"output_dir={tmp_path}", "name=cli")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert config.load(str(tmp_path / "cli" / "config.toml")).init_from == str(source)
    assert (tmp_path / "cli" / "consensus.safetensors").is_file()


def _write_variant(finished, tmp_path: Path, change: str) -> Path:
    _, result = finished
    flat = _leaves(result.consensus_params)
    first = next(iter(flat))
    if change == "missing":
        del flat[first]
    elif change == "shape":
        flat[first] = np.zeros((*flat[first].shape, 2), flat[first].dtype)
    elif change == "dtype":
        flat[first] = flat[first].astype(ml_dtypes.bfloat16)
    return io.save_safetensors(io.unflatten(flat), tmp_path / f"{change}.safetensors")


@pytest.mark.parametrize(
    "change, words",
    [("missing", "missing"), ("shape", "shape"), ("dtype", "dtype"), ("absent", "not found")],
)
def test_cli_init_that_does_not_fit_is_one_line_exit_2(finished, tmp_path, capsys, change, words):
    source = (
        tmp_path / "absent.safetensors" if change == "absent" else _write_variant(finished, tmp_path, change)
    )
    out = tmp_path / "runs"
    argv = ["run", "--quiet", "--init", str(source), *_sets(*BASE, f"output_dir={out}", "name=bad")]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meta-consensus: init_from:"), err
    assert words in lines[0].lower(), err
    assert not (out / "bad").exists() or os.listdir(out / "bad") == []


def test_init_from_must_be_a_path():
    with pytest.raises(config.ConfigError, match="init_from"):
        config.load(None, ["init_from=''"])


def test_the_runs_orbax_checkpoint_merges_like_its_consensus_safetensors(finished, tmp_path):
    """A real run's orbax checkpoint as a merge input: the same keys and bits as its safetensors file."""
    from meta_consensus.checkpoint import TreeReader

    run_dir, result = finished
    with TreeReader(run_dir / "checkpoints") as r:  # the latest round of the run
        assert r.step_directory.name == "1"
        _assert_bit_exact({k: r.get(k) for k in r.specs}, _leaves(result.consensus_params))
    out = tmp_path / "merged"
    argv = ["merge", "--method", "median", "--quiet", "--out", str(out)]
    assert cli.main([*argv, str(run_dir / "checkpoints" / "1"), str(run_dir / "consensus.safetensors")]) == 0
    _assert_bit_exact(_leaves(io.load_safetensors(out)), _leaves(result.consensus_params))
