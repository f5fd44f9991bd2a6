"""Checkpoints of a whole run with orbax's CheckpointManager (atomic, the last K kept, no pickle).

One checkpoint per saved round, ``<run>/checkpoints/<round>/``, with two items:

* ``arrays`` (orbax StandardSave): the consensus, the nodes' TrainState
  (params, optimizer states, key data, step counts), the FedAvg baseline's and, in a
  LoRA run, the frozen part (the base, which base deltas change, and FFA-LoRA's shared a).
  Restored against the shapes, dtypes and shardings of a freshly initialized
  state, so a sharded run restores sharded arrays, collectively on every process.
* asynchronous rounds (:mod:`meta_consensus.async_rounds`): every in-flight fit's delta in
  ``arrays``, and the clock, the versions sent, the arrival times and fit counts in ``meta``.
* ``meta`` (JSON): the round counter, the root key, the aggregator state (small
  arrays: DP key and clip norm, vote diagnostics; stored as raw bytes so they
  come back bit for bit), the privacy ledger, the history of every round and a
  fingerprint of the config, which must match on resume.

orbax writes each checkpoint to a temporary directory and renames it when
complete, so a run killed while saving leaves the previous checkpoints intact.
Saves are asynchronous: :meth:`RunCheckpoints.save` returns once the arrays are
copied off the devices and the files are written by a background thread while
the next rounds run; orbax finishes a save before it starts the next one, and
:meth:`RunCheckpoints.wait` / :meth:`RunCheckpoints.close` finish the last one.

A checkpoint that cannot be read (files overwritten or cut short) is skipped by
:meth:`RunCheckpoints.restore_intact`, which falls back to the newest intact one
(``keep_checkpoints`` > 1 exists for this) and moves the damaged ones aside to
``<run>/checkpoints.damaged/`` (never deleted), so the resumed run can write
those rounds again. A checkpoint of a different config is not damage: it stops
the resume with a :class:`CheckpointError`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus.mesh import to_host
from consensus.privacy import PrivacyLedger
from meta_consensus.async_rounds import AsyncState
from meta_consensus.config import Config, dumps, to_dict
from meta_consensus.coordinator import CoordinatorState, RoundInfo
from strategies.trainer import TrainState

PyTree = Any


class CheckpointError(ValueError):
    """A run cannot continue from its checkpoints: a different config, or none intact (a user error)."""


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint that could not be restored: its round, why, and where it was moved.

    Attributes:
      step: the checkpoint's round.
      reason: the error that restoring it raised (its type and first line).
      moved_to: where it was set aside (``<dir>.damaged/<step>``), None when left in place.
    """

    step: int
    reason: str
    moved_to: Path | None = None


# Settings that do not change a run's numbers: a resume may change them.
OPERATIONAL = {"name": "_", "output_dir": "_", "rounds": 1, "checkpoint_every": 0, "keep_checkpoints": 1}
OPERATIONAL_OPTIONAL = {"heartbeat_timeout_s": 1}


def _numbers_config(cfg: Config) -> Config:
    changes = dict(OPERATIONAL)
    changes.update({k: v for k, v in OPERATIONAL_OPTIONAL.items() if hasattr(cfg, k)})
    return cfg.replace(**changes)


def fingerprint(cfg: Config) -> str:
    """Hash of everything that changes the run's numbers.

    The name, paths, the round count and the operational settings (``OPERATIONAL``) are excluded.

    Args:
      cfg: the run config.

    Returns:
      The first 16 hex digits of the SHA-256 of the config's TOML without those settings.
    """
    return hashlib.sha256(dumps(_numbers_config(cfg)).encode()).hexdigest()[:16]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def config_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The settings (dotted keys) in which ``cfg`` differs from the config a checkpoint saved.

    A setting the checkpoint's version did not have counts as its default then (a newer
    version's new keys keep old checkpoints resumable while they keep their defaults).

    Args:
      saved: the config dict a checkpoint saved (``to_dict`` of its numbers config).
      cfg: the config now.

    Returns:
      One line per differing key, ``"<key> = <then> in the checkpoint, <now> now"``, sorted.
    """
    now = _flat(to_dict(_numbers_config(cfg)))
    then = _flat(saved)
    defaults = _flat(to_dict(_numbers_config(type(cfg)())))
    out = []
    for key in sorted(now):
        before = then.get(key, defaults.get(key, now[key]))
        if _canonical(before) != _canonical(now[key]):
            out.append(f"{key} = {before!r} in the checkpoint, {now[key]!r} now")
    return out


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _nodes_dict(s: TrainState | None) -> dict[str, Any] | None:
    if s is None:
        return None
    key = jax.random.key_data(s.key) if _is_key(s.key) else s.key
    return {"params": s.params, "opt_state": s.opt_state, "key": key, "step": s.step}


def _encode(x: Any) -> dict[str, Any]:
    a = np.asarray(jax.random.key_data(x) if _is_key(x) else x)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def _decode(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _abstract(tree: PyTree) -> PyTree:
    def leaf(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def _placed_like(restored: Any, like: Any) -> Any:
    """``restored`` placed as ``like`` is: on its shardings (orbax did that), uncommitted where ``like`` is.

    orbax commits every array it restores to a device; a fresh run's consensus is not
    committed, so jax moves it next to the mesh-sharded node states in a jitted call, while a
    committed copy on device 0 makes that call fail (incompatible devices).
    """
    if isinstance(like, jax.Array) and not like.committed and isinstance(restored, jax.Array):
        return jnp.asarray(np.asarray(restored))
    return restored


class RunCheckpoints:
    """Save and restore :class:`CoordinatorState` + history under ``<run_dir>/checkpoints``.

    Args:
      run_dir: the run folder; checkpoints go to its ``checkpoints`` subfolder.
      cfg: the run config (its fingerprint and numbers are saved with every checkpoint;
        ``keep_checkpoints`` bounds how many are kept).
      asynchronous: save in the background (orbax's asynchronous save, and in a single process
        a worker thread); False saves synchronously.
    """

    def __init__(self, run_dir: Path, cfg: Config, *, asynchronous: bool = True):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.cfg = cfg
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep_checkpoints, enable_async_checkpointing=asynchronous, create=True
            ),
        )
        # Even orbax's asynchronous save blocks its caller (the metadata, the history's JSON,
        # the device-to-host copy, orbax's bookkeeping) for a large share of a whole digits
        # round. In a single process the save call runs on one worker
        # thread instead, so the round loop only hands it the (immutable) arrays. One worker
        # keeps saves in order; every other method first waits for the save in flight and
        # re-raises its error. Several processes save synchronously: orbax's multi-process
        # barriers are kept on the thread that also runs the collectives.
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            if asynchronous and jax.process_count() == 1
            else None
        )
        self._pending: concurrent.futures.Future | None = None

    def _settle(self) -> None:
        """Wait for the save call in flight on the worker thread; raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def latest(self) -> int | None:
        """The newest round with a checkpoint.

        Returns:
          The round, or None when there is no checkpoint.
        """
        self._settle()
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The rounds with a checkpoint, oldest first.

        Returns:
          The rounds, sorted ascending.
        """
        self._settle()
        return sorted(int(s) for s in self.manager.all_steps())

    def wait(self) -> None:
        """Block until the last asynchronous save is on disk."""
        self._settle()
        self.manager.wait_until_finished()

    def save(self, state: CoordinatorState, history: list[RoundInfo]) -> None:
        """Save ``state`` and ``history`` as the checkpoint of round ``state.round``.

        Returns at once in a single process: the save runs on a worker thread and is on
        disk after :meth:`wait` or :meth:`close` (or before the next save starts). A save
        that failed raises at the next call to this object.

        Args:
          state: the coordinator's state after a round.
          history: the rounds so far (copied: the caller may keep appending).
        """
        history = list(history)  # the caller's list grows while the worker reads it
        if self._worker is None:
            self._save_now(state, history)
            return
        self._settle()
        self._pending = self._worker.submit(self._save_now, state, history)

    def _save_now(self, state: CoordinatorState, history: list[RoundInfo]) -> None:
        ocp = self._ocp
        arrays = {
            "consensus": state.consensus,
            "nodes": _nodes_dict(state.nodes),
            "fedavg": state.fedavg,
            "fedavg_nodes": _nodes_dict(state.fedavg_nodes),
            "frozen": state.frozen,  # a LoRA run's base (and shared a): it changes with base deltas
            # Asynchronous rounds: every in-flight fit's delta (the rest of the schedule is in meta).
            "schedule_deltas": None if state.schedule is None else state.schedule.deltas,
        }
        arrays = {k: v for k, v in arrays.items() if v is not None}
        agg_leaves = jax.tree.leaves(state.aggregator)
        meta = {
            "round": int(state.round),
            "fingerprint": fingerprint(self.cfg),
            "config": to_dict(_numbers_config(self.cfg)),
            "key": _encode(to_host(state.key)),
            "aggregator": [_encode(to_host(x) if isinstance(x, jax.Array) else x) for x in agg_leaves],
            "ledger": None if state.ledger is None else state.ledger.to_dict(),
            "history": [h.to_json() for h in history],
            "schedule": None if state.schedule is None else state.schedule.meta(),
        }
        self.manager.save(
            int(state.round),
            args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def restore(
        self, template: CoordinatorState, step: int | None = None
    ) -> tuple[CoordinatorState, list[RoundInfo]]:
        """The checkpoint at ``step`` (default: the latest) against a freshly initialized state.

        Args:
          template: a freshly initialized state of the same config (shapes, shardings, key types).
          step: the round to restore (default: the latest).

        Returns:
          ``(state, history)`` as saved.

        Raises:
          FileNotFoundError: when there is no checkpoint.
          CheckpointError: when the checkpoint was written by a different config.
          ValueError: when the aggregator state saved does not match this config's.
        """
        ocp = self._ocp
        self._settle()
        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if "config" in meta:
            diffs = config_differences(meta["config"], self.cfg)
            what = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
        else:  # a checkpoint of an earlier version: the hash alone
            diffs = [] if meta["fingerprint"] == fingerprint(self.cfg) else ["fingerprint"]
            what = f"fingerprint {meta['fingerprint']} != {fingerprint(self.cfg)}"
        if diffs:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} was written by a different config ({what}); resume "
                "with the config saved in the run directory (--config <run>/config.toml) or start a new "
                "run name"
            )
        target = {
            "consensus": template.consensus,
            "nodes": _nodes_dict(template.nodes),
            "fedavg": template.fedavg,
            "fedavg_nodes": _nodes_dict(template.fedavg_nodes),
            "frozen": template.frozen,
            "schedule_deltas": None if template.schedule is None else template.schedule.deltas,
        }
        target = {k: v for k, v in target.items() if v is not None}
        arrays = self.manager.restore(
            step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(_abstract(target)))
        )["arrays"]
        arrays = {k: jax.tree.map(_placed_like, v, target[k]) for k, v in arrays.items()}

        def nodes(d: dict[str, Any] | None, like: TrainState | None) -> TrainState | None:
            if d is None or like is None:
                return None
            key = d["key"]
            if _is_key(like.key):
                key = jax.random.wrap_key_data(key, impl=jax.random.key_impl(like.key))
            return TrainState(d["params"], d["opt_state"], key, d["step"])

        leaves, treedef = jax.tree.flatten(template.aggregator)
        saved = meta["aggregator"]
        if len(saved) != len(leaves):
            raise ValueError(
                f"checkpoint aggregator state has {len(saved)} arrays, this config's has {len(leaves)}"
            )
        restored = []
        for like, enc in zip(leaves, saved, strict=True):
            a = _decode(enc)
            if _is_key(like):
                restored.append(jax.random.wrap_key_data(jnp.asarray(a), impl=jax.random.key_impl(like)))
            elif isinstance(like, jax.Array | np.ndarray | np.generic):
                restored.append(jnp.asarray(a))
            else:  # Python scalars (a rule's ``linear`` flag)
                restored.append(type(like)(a.item()))
        node_states = nodes(arrays.get("nodes"), template.nodes)
        assert node_states is not None  # template.nodes is a TrainState, so its arrays were restored
        state = CoordinatorState(
            round=int(meta["round"]),
            consensus=arrays["consensus"],
            nodes=node_states,
            aggregator=jax.tree.unflatten(treedef, restored),
            fedavg=arrays.get("fedavg"),
            fedavg_nodes=nodes(arrays.get("fedavg_nodes"), template.fedavg_nodes),
            ledger=None if meta["ledger"] is None else PrivacyLedger.from_dict(meta["ledger"]),
            key=jnp.asarray(_decode(meta["key"])),
            frozen=arrays.get("frozen"),
            schedule=(
                None
                if template.schedule is None
                else AsyncState.from_meta(meta["schedule"], arrays["schedule_deltas"])
            ),
        )
        history = [RoundInfo.from_json(h) for h in meta["history"]]
        return state, history

    def restore_intact(
        self, template: CoordinatorState, *, move_damaged: bool = True
    ) -> tuple[CoordinatorState, list[RoundInfo], list[SkippedCheckpoint]]:
        """The newest checkpoint that restores, and the newer ones skipped as damaged.

        A checkpoint of a different config raises :class:`CheckpointError` at once (it is not
        damage). The damaged newer ones are moved to ``<run>/checkpoints.damaged/`` (by process 0,
        the others wait) so that the resumed run can save those rounds again; nothing is moved
        when none restores (a wrong environment, e.g. another device count, looks like damage
        to every checkpoint alike).

        Args:
          template: a freshly initialized state of the same config (see :meth:`restore`).
          move_damaged: move the damaged newer checkpoints aside (False: leave them).

        Returns:
          ``(state, history, skipped)``: the newest intact checkpoint and the newer ones skipped.

        Raises:
          CheckpointError: naming the folder when there is no checkpoint or none restores, or
            at once for a checkpoint of a different config.
        """
        skipped: list[SkippedCheckpoint] = []
        for step in reversed(self.steps()):
            try:
                state, history = self.restore(template, step)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any read/decode failure means this one is damaged
                first = (str(e).strip().splitlines() or [""])[0][:200]
                skipped.append(SkippedCheckpoint(step, f"{type(e).__name__}: {first}"))
                continue
            if skipped and move_damaged:
                skipped = self._set_aside(skipped)
            return state, history, skipped
        if not skipped:
            raise CheckpointError(f"no checkpoint to resume from in {self.directory}")
        raise CheckpointError(
            f"no intact checkpoint in {self.directory}: "
            + "; ".join(f"round {s.step}: {s.reason}" for s in skipped)
        )

    def _set_aside(self, skipped: list[SkippedCheckpoint]) -> list[SkippedCheckpoint]:
        aside = self.directory.with_name(self.directory.name + ".damaged")
        moved = []
        for s in skipped:
            dest = aside / str(s.step)
            k = 1
            while dest.exists():
                dest, k = aside / f"{s.step}-{k}", k + 1
            if jax.process_index() == 0:
                aside.mkdir(parents=True, exist_ok=True)
                (self.directory / str(s.step)).rename(dest)
            moved.append(dataclasses.replace(s, moved_to=dest))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("meta_consensus.checkpoints.set_aside")
        self.manager.reload()
        return moved

    def close(self) -> None:
        """Finish the save in flight (re-raising its error), stop the worker and close orbax."""
        try:
            self._settle()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self.manager.wait_until_finished()
            self.manager.close()


def load_history(path: Path) -> list[RoundInfo]:
    """The rounds of a metrics.jsonl file.

    Args:
      path: the metrics.jsonl file.

    Returns:
      One :class:`RoundInfo` per non-empty line, in file order.
    """
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(RoundInfo.from_json(json.loads(line)))
    return out


# ----------------------------------------------------------------------------- reading one tree leaf by leaf

# The item of a checkpoint that holds the arrays, and the file orbax writes into every finished step.
ARRAYS_ITEM = "arrays"
_STEP_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")


def is_step_directory(path: Path) -> bool:
    """Whether ``path`` looks like one saved round of :class:`RunCheckpoints` (``<run>/checkpoints/<n>``).

    Args:
      path: a folder.

    Returns:
      True when it holds an ``arrays`` item and orbax's finished-step marker.
    """
    path = Path(path)
    return (path / ARRAYS_ITEM).is_dir() and any((path / m).exists() for m in _STEP_MARKERS)


def _finished_steps(directory: Path) -> list[Path]:
    """The step folders under ``directory`` (orbax's unfinished ``<n>.orbax-checkpoint-tmp-*`` are not)."""
    steps = [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and is_step_directory(p)]
    return sorted(steps, key=lambda p: int(p.name))


def find_step_directory(path: str | Path) -> Path | None:
    """The checkpoint an input path names.

    Args:
      path: a step folder, a ``checkpoints`` folder or a run folder.

    Returns:
      The step folder itself, else the latest step of a ``checkpoints`` folder or of a run
      folder's ``checkpoints/``; None when ``path`` is none of these.
    """
    path = Path(path)
    if not path.is_dir():
        return None
    if is_step_directory(path):
        return path
    for directory in (path, path / "checkpoints"):
        if directory.is_dir():
            steps = _finished_steps(directory)
            if steps:
                return steps[-1]
    return None


class TreeReader:
    """One tree of a :class:`RunCheckpoints` checkpoint (default the consensus), read a few leaves at a time.

    The same interface as :class:`consensus.io.CheckpointReader` (``specs``, ``read_into``,
    ``get``, ``close``), so the merge command takes this package's orbax checkpoints as
    inputs: keys are the dotted keys of :func:`consensus.io.flatten` (``Dense_0.kernel``,
    ``layers.0.w``), the ones :func:`consensus.io.save_safetensors` writes for the same tree.

    The tree's shapes and dtypes come from orbax's metadata (no array read). orbax restores
    trees, not single arrays, but it restores a *part* of a tree: each restore asks for a
    group of leaves only (``PyTreeRestore(partial_restore=True)`` when their paths are all
    dict keys, else the whole item with :data:`orbax.checkpoint.PLACEHOLDER` for every other
    leaf, which is not read). Every orbax restore re-reads and walks the checkpoint's whole
    metadata (tens of milliseconds for a run's checkpoint of a few thousand arrays), so the
    leaves are restored in groups: the requested leaf and the ones after it in :attr:`specs`
    order, up to ``max(largest leaf, group_bytes)`` in all. A group is held until its leaves
    are read (each once, in order: what the merge does; a leaf read out of order restores
    its own group). Memory: one group plus the leaf being copied out, never the whole tree.

    Args:
      path: a step folder ``<run>/checkpoints/<round>``, a ``checkpoints`` folder or a run
        folder (their latest step).
      tree: which tree of the ``arrays`` item: ``"consensus"`` or ``"fedavg"``.
      group_bytes: the least a group may hold (a larger leaf is restored alone).

    Raises:
      consensus.io.CheckpointError: (a user error) for a folder that is not such a checkpoint,
        one whose metadata cannot be read, or a leaf that cannot be restored.
    """

    GROUP_BYTES = 8 << 20

    def __init__(self, path: str | Path, *, tree: str = "consensus", group_bytes: int = GROUP_BYTES):
        import orbax.checkpoint as ocp

        from consensus import io

        self._ocp, self._io = ocp, io
        self.path = Path(path)
        step = find_step_directory(self.path)
        if step is None:
            raise io.CheckpointError(
                f"{self.path}: not a meta-consensus orbax checkpoint (a <run>/checkpoints/<round> folder "
                "with an 'arrays' item) nor a safetensors checkpoint"
            )
        self.step_directory = step
        self.tree = tree
        self._handler = ocp.PyTreeCheckpointHandler()
        try:
            metadata = self._handler.metadata(step / ARRAYS_ITEM)
            self._metadata = metadata.tree if hasattr(metadata, "tree") else metadata
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types for a damaged folder
            self.close()
            why = _first_line(e)
            raise io.CheckpointError(f"{step}: cannot read the checkpoint's metadata ({why})") from e
        if not isinstance(self._metadata, dict) or tree not in self._metadata:
            items = sorted(self._metadata) if isinstance(self._metadata, dict) else []
            self.close()
            raise io.CheckpointError(f"{step}: no {tree!r} in its arrays item (it holds {items})")
        self.metadata = {"step": step.name, "tree": tree}
        self._paths: dict[str, tuple[Any, ...]] = {}  # dotted key -> path of the leaf in the arrays item
        self.specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(self._metadata[tree])[0]]
        try:
            flat = io.flatten(self._metadata[tree])  # the same order as ``paths``
        except io.CheckpointKeyError as e:
            self.close()
            raise io.CheckpointError(f"{step}: {tree}: {e}") from e
        for leaf_path, (key, meta) in zip(paths, flat.items(), strict=True):
            shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
            if shape is None or dtype is None:
                self.close()
                raise io.CheckpointError(f"{step}: {tree}.{key} is a {type(meta).__name__}, not an array")
            self._paths[key] = (jax.tree_util.DictKey(tree), *leaf_path)
            self.specs[key] = (tuple(int(d) for d in shape), np.dtype(dtype))
        self._order = list(self.specs)
        self._index = {k: i for i, k in enumerate(self._order)}
        self._budget = max([group_bytes, *(self.nbytes(k) for k in self._order)])
        self._held: dict[str, np.ndarray] = {}  # the restored group's leaves not read yet
        self.restores = 0  # orbax restore calls so far

    def __enter__(self) -> TreeReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop the group in hand and close orbax's handler (idempotent)."""
        self._held = {}
        handler, self._handler = getattr(self, "_handler", None), None
        if handler is not None:
            handler.close()

    def keys(self) -> list[str]:
        """The tree's dotted keys, in :attr:`specs` order.

        Returns:
          The keys.
        """
        return list(self.specs)

    def nbytes(self, key: str) -> int:
        """The size of the leaf ``key`` in bytes, from its shape and dtype (nothing is read).

        Args:
          key: a dotted key.

        Returns:
          The leaf's byte count.

        Raises:
          KeyError: for a key not in the tree.
        """
        shape, dtype = self.specs[key]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def get(self, key: str) -> np.ndarray:
        """The leaf ``key`` as a numpy array (from the group in hand, else a restore of its group).

        Args:
          key: a dotted key.

        Returns:
          The leaf, in its saved shape and dtype.

        Raises:
          consensus.io.CheckpointKeyError: for a key not in the tree.
          consensus.io.CheckpointError: when the leaf cannot be restored.
        """
        if key not in self.specs:
            raise self._io.CheckpointKeyError(f"{self.path} has no key {key!r}")
        if key not in self._held:
            self._held = {}  # a leaf out of order: drop the group in hand
            group: list[str] = []
            total = 0
            for k in self._order[self._index[key] :]:
                if group and total + self.nbytes(k) > self._budget:
                    break
                group.append(k)
                total += self.nbytes(k)
            self._held = self._restore(group)
        return self._held.pop(key)

    def _restore(self, keys: list[str]) -> dict[str, np.ndarray]:
        ocp = self._ocp
        wanted = {self._paths[k]: k for k in keys}

        def leaf_args(key: str) -> tuple[Any, Any]:
            shape, dtype = self.specs[key]
            return jax.ShapeDtypeStruct(shape, dtype), ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)

        if all(isinstance(part, jax.tree_util.DictKey) for path in wanted for part in path):
            item: dict[str, Any] = {}  # nested dicts holding only the wanted leaves
            restore_args: dict[str, Any] = {}
            for path, key in wanted.items():
                for tree, value in zip((item, restore_args), leaf_args(key), strict=True):
                    for part in path[:-1]:
                        tree = tree.setdefault(part.key, {})
                    tree[path[-1].key] = value
            args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        else:  # a list on the way: the whole item, placeholders for the leaves not wanted

            def tree_of(which: int) -> Any:
                def pick(path: Any, _meta: Any) -> Any:
                    key = wanted.get(tuple(path))
                    return ocp.PLACEHOLDER if key is None else leaf_args(key)[which]

                return jax.tree_util.tree_map_with_path(pick, self._metadata)

            args = ocp.args.PyTreeRestore(item=tree_of(0), restore_args=tree_of(1))
        try:
            self.restores += 1
            restored = self._handler.restore(self.step_directory / ARRAYS_ITEM, args=args)
            out = {}
            for path, key in wanted.items():
                leaf = restored
                for part in path:
                    leaf = leaf[part.idx if hasattr(part, "idx") else part.key]
                out[key] = np.asarray(leaf)
        except Exception as e:  # noqa: BLE001 - a damaged data file: any tensorstore / orbax error
            raise self._io.CheckpointError(
                f"{self.step_directory}: cannot restore {self.tree}.{keys[0]} ({_first_line(e)})"
            ) from e
        for key, array in out.items():
            shape, dtype = self.specs[key]
            if array.shape != shape or array.dtype != dtype:
                raise self._io.CheckpointError(
                    f"{self.step_directory}: {self.tree}.{key} restored as {array.dtype}{list(array.shape)}, "
                    f"its metadata says {dtype}{list(shape)}"
                )
        return out

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read the leaf ``key`` into ``out`` (its shape and dtype).

        Args:
          key: a dotted key.
          out: a numpy array of the leaf's shape and dtype.

        Raises:
          consensus.io.CheckpointKeyError: for a key not in the tree.
          ValueError: when ``out``'s shape or dtype is not the leaf's.
        """
        if key not in self.specs:
            raise self._io.CheckpointKeyError(f"{self.path} has no key {key!r}")
        shape, dtype = self.specs[key]
        if out.shape != shape or out.dtype != dtype:
            raise ValueError(f"read_into {key!r}: out must be {shape} {dtype}, got {out.shape} {out.dtype}")
        out[...] = self.get(key)

    def check_against(self, like: PyTree) -> None:
        """Check every key, shape and dtype of the template ``like``; the error names the first mismatch.

        Args:
          like: a tree of arrays (or shape-dtype structs) with the expected keys.

        Raises:
          consensus.io.CheckpointKeyError: naming the first mismatch.
        """
        self._io.check_against(self.specs, like, str(self.path))


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
