"""LoRA runs: the nodes train adapters on a frozen base, the coordinator merges the adapters.

A config with a ``[nodes.lora]`` table (:class:`strategies.lora.LoraSettings`: ``rank``,
``alpha``, ``targets``, ``dropout``, ``freeze_a``) turns a run into a LoRA run:

* the task becomes a :class:`strategies.lora.LoraTask` over the configured task's model: the
  params the nodes train, stack, send and checkpoint are the adapter tree (``b`` alone under
  FFA-LoRA), and the frozen part (the base, the shared ``a``) is one tree the coordinator keeps
  (``CoordinatorState.frozen``);
* the initial params of the run (the task's init, ``init_from`` or ``train(initial_params=...)``)
  are the *base* model; the adapter starts at ``b = 0``;
* each round the valid nodes' adapters are merged by :func:`strategies.lora.merge_round`
  (``consensus.lora.merge_adapters`` with ``vote.adapter_method``, and ``vote.rule`` applied
  robustly in ``vote.adapter_space`` unless it is ``"mean"``), a ``base_delta`` is added to the
  base, and the new adapter (and base delta) is what every node receives;
* every round logs the bytes each node sent and received and the parameter counts.

What a LoRA run does not combine with is refused when the config is checked
(:func:`check_config`): node-level DP (the example-level DP-SGD of the nodes works on the
adapter gradients), client sampling, grouped votes, pre-aggregators, server-guided rules,
convex weights other than uniform, and meshes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from meta_consensus.config.errors import ConfigError
from strategies.lora import LoraError, LoraSettings, LoraTask, merge_round, tree_bytes, tree_size

if TYPE_CHECKING:
    from meta_consensus.config.schema import Config

PyTree = Any

#: vote.rule values that mean "no robust rule": the adapter method's own (weighted) combination.
PLAIN_RULES = ("mean",)


def enabled(cfg: Config) -> bool:
    """Whether ``cfg`` is a LoRA run (it has a ``[nodes.lora]`` table).

    Args:
      cfg: the run config.

    Returns:
      True for a LoRA run.
    """
    return cfg.nodes.lora is not None


def check_targets(settings: LoraSettings, task: Any) -> None:
    """Check that the targets and rank fit the task's model (on abstract shapes, nothing is computed).

    Args:
      settings: the ``[nodes.lora]`` settings.
      task: the task whose model the adapters wrap.

    Raises:
      ConfigError: one line naming the target that matches nothing (with some valid paths) or
        the rank that does not fit.
    """
    abstract = jax.eval_shape(task.init, jax.random.key(0))
    try:
        LoraTask(task, settings, abstract, jax.random.key(0))
    except LoraError as e:
        raise ConfigError(f"nodes.lora: {e}") from None


def check_config(cfg: Config) -> None:
    """Check the LoRA keys and what a LoRA run does not combine with (ConfigError naming the key).

    The targets are checked against the model when the task is built (:func:`wrap_task`).

    Args:
      cfg: the run config (nothing is checked without ``[nodes.lora]``).

    Raises:
      ConfigError: invalid LoRA settings, an unknown adapter method or space, FFA-LoRA without
        the frozen a (or the other way round), a setting listed in the module docstring, or a
        vote rule that needs more than the nodes' updates.
    """
    from consensus.lora import ADAPTER_METHODS, SPACES
    from consensus.registry import RULES

    v = cfg.vote
    if not enabled(cfg):
        return
    settings = cfg.nodes.lora
    assert settings is not None
    try:
        settings.check()
    except LoraError as e:
        raise ConfigError(f"nodes.lora: {e}") from None
    if v.adapter_method not in ADAPTER_METHODS.names():
        raise ConfigError(
            f"vote.adapter_method = {v.adapter_method!r} is not valid; "
            f"choose one of {ADAPTER_METHODS.names()}"
        )
    if v.adapter_space not in SPACES:
        raise ConfigError(
            f"vote.adapter_space = {v.adapter_space!r} is not valid; choose one of {list(SPACES)}"
        )
    if (v.adapter_method == "ffa") != bool(settings.freeze_a):
        raise ConfigError(
            f"vote.adapter_method = {v.adapter_method!r} with nodes.lora.freeze_a = {settings.freeze_a}: "
            "FFA-LoRA is the method and the frozen a together (set both, or neither)"
        )
    refusals = (
        (cfg.dp.enabled and cfg.dp.level == "node", "dp.level", cfg.dp.level, 'use dp.level = "example"'),
        (cfg.nodes.sampled, "nodes.sampling", cfg.nodes.sampling, 'use "full"'),
        (v.groups > 1, "vote.groups", v.groups, "use 0"),
        (bool(v.pre), "vote.pre", list(v.pre), "use []"),
        (v.server_step > 0, "vote.server_step", v.server_step, "use 0"),
        (cfg.weights.objective != "uniform", "weights.objective", cfg.weights.objective, 'use "uniform"'),
        (cfg.mesh.enabled, "mesh", cfg.mesh, "use no mesh"),
    )
    for refused, key, value, fix in refusals:
        if refused:
            raise ConfigError(
                f"{key} = {value!r} does not combine with nodes.lora (the adapters are merged by "
                f"vote.adapter_method with vote.rule); {fix}"
            )
    needs = set(RULES[v.rule].needs) - {"params", "key"}
    if v.rule not in PLAIN_RULES and needs:
        raise ConfigError(
            f"vote.rule = {v.rule!r} needs {sorted(needs)}, which a LoRA run does not provide; "
            "choose a rule of the nodes' updates alone (median, krum, multi_krum, trimmed_mean, ...)"
        )


def wrap_task(cfg: Config, task: Any) -> LoraTask:
    """The LoRA task of a config over ``task``'s model (its base given per call as ``frozen``).

    Args:
      cfg: the run config, with its ``[nodes.lora]`` table.
      task: the configured task, whose model the adapters wrap.

    Returns:
      The LoRA task.

    Raises:
      ConfigError: a target that matches nothing, or a rank that does not fit.
    """
    settings = cfg.nodes.lora
    assert settings is not None
    if getattr(task, "pretrained", False) and settings.pretrain_steps > 0:
        # Pretraining on the public pool exists for a randomly initialized base; a checkpoint's
        # weights would be trained away from it with the coordinator's own settings.
        raise ConfigError(
            f"nodes.lora.pretrain_steps = {settings.pretrain_steps}: the task "
            f"{getattr(task, 'name', 'task')!r} starts from a pretrained model; use 0"
        )
    abstract = jax.eval_shape(task.init, jax.random.key(0))
    try:
        return LoraTask(task, settings, abstract, jax.random.key(cfg.seed))
    except LoraError as e:
        raise ConfigError(f"nodes.lora: {e}") from None


@dataclasses.dataclass
class LoraRound:
    """The coordinator's side of a LoRA run: the first adapter, the merge and what it reports.

    Attributes:
      cfg: the run config.
      task: the run's LoRA task.
      frozen: the frozen part the fleet's next fit or evaluation reads (the coordinator sets it).
    """

    cfg: Config
    task: LoraTask
    frozen: Any = None

    def start(self, base: PyTree, key: jax.Array) -> tuple[PyTree, dict[str, Any]]:
        """The first round's trainable params (``b = 0``) and frozen part, from the base model.

        Args:
          base: the base model's params.
          key: the run's params key (the adapter's init and the ``a`` draw derive from it).

        Returns:
          ``(params, frozen)``: the adapter tree the nodes train, and ``{"base", "a"}``.
        """
        k_a, k_init = jax.random.split(jax.random.fold_in(key, 0x10A))
        frozen = self.task.initial_frozen(base, k_a)
        params = self.task.init(k_init)
        if self.task.settings.freeze_a:  # the shared a of the frozen part, b = 0
            params = self.task.trainable(self.task.full_adapter(params, frozen))
        return params, frozen

    def pretrain(self, data: Any, base: PyTree, key: jax.Array) -> PyTree:
        """The base after ``nodes.lora.pretrain_steps`` Adam steps on the task's general pool.

        One model (learning rate 3e-3, the run's batch size) on the public pool that no node
        owns, from the run's key: a resumed run pretrains the same base (and then restores the
        checkpoint's). Nothing is cached outside the run.

        Args:
          data: the task's data (any process's: every one holds the general pool).
          base: the base model's params.
          key: the run's params key.

        Returns:
          The pretrained base (``base`` itself when ``pretrain_steps`` is 0).

        Raises:
          ConfigError: pretraining asked for on a task whose general pool is empty.
        """
        from meta_consensus.warm_start import public_warm_start

        return public_warm_start(
            self.task.base_task,
            data,
            base,
            key,
            steps=self.task.settings.pretrain_steps,
            learning_rate=3e-3,
            batch_size=self.cfg.nodes.batch_size,  # type: ignore[arg-type]
            setting="nodes.lora.pretrain_steps",
        )

    def rule(self, answered: int) -> Any:
        """The robust rule on ``answered`` valid nodes, or None for the method's plain combination.

        Args:
          answered: the valid nodes of the round (sets the rule's f).

        Returns:
          The aggregator of ``vote.rule``, or None for ``"mean"``.
        """
        from consensus import registry

        v = self.cfg.vote
        if v.rule in PLAIN_RULES:
            return None
        return registry.make(v.rule, v.f(answered), **v.options)

    def merge(
        self,
        frozen: Mapping[str, Any],
        submitted: PyTree,
        valid: np.ndarray,
        key: jax.Array,
        start: PyTree,
    ) -> Any:
        """The round's :class:`strategies.lora.RoundMerge` of the valid nodes' adapters.

        Args:
          frozen: the frozen part the nodes trained on.
          submitted: every node's adapter, stacked on a leading axis.
          valid: (n,) bool, the nodes whose adapters are merged.
          key: the round's merge key.
          start: the adapter the round started from.

        Returns:
          The merge: the new adapter, the new frozen part and the base delta, if any.
        """
        rows = np.flatnonzero(valid)
        stacked = jax.tree.map(lambda x: x[rows], submitted)
        v = self.cfg.vote
        return merge_round(
            self.task,
            frozen,
            stacked,
            method=v.adapter_method,
            rule=self.rule(len(rows)),
            space=v.adapter_space,
            key=key,
            start=start,
        )

    def sizes(self, frozen: Mapping[str, Any], params: PyTree) -> dict[str, int]:
        """Parameter counts and bytes: the model, and what a node trains and sends.

        Args:
          frozen: the frozen part (its base is the model).
          params: the adapter tree a node trains.

        Returns:
          ``model_params``, ``model_bytes``, ``trainable_params`` and ``trainable_bytes``.
        """
        return {
            "model_params": tree_size(frozen["base"]),
            "model_bytes": tree_bytes(frozen["base"]),
            "trainable_params": tree_size(params),
            "trainable_bytes": tree_bytes(params),
        }


class FrozenTrainer:
    """A node trainer whose every fit and evaluation reads the current frozen part of ``holder``.

    The fleet's code calls ``trainer.fit(...)`` and ``trainer.evaluate(stacked, batch)`` as in
    any run; this hands them ``frozen=holder.frozen`` (the base set for the call).

    Args:
      trainer: the :class:`strategies.trainer.NodeTrainer` of the LoRA task.
      holder: any object whose ``frozen`` attribute is the frozen part (a :class:`LoraRound`, a
        Flower node).
    """

    def __init__(self, trainer: Any, holder: Any):
        self._trainer = trainer
        self._holder = holder

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """``NodeTrainer.fit`` with the holder's frozen part.

        Args:
          *args: ``NodeTrainer.fit``'s positional arguments.
          **kwargs: its keyword arguments (all but ``frozen``).

        Returns:
          What ``NodeTrainer.fit`` returns.
        """
        return self._trainer.fit(*args, frozen=self._holder.frozen, **kwargs)

    def evaluate(self, stacked: PyTree, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``NodeTrainer.evaluate`` with the holder's frozen part.

        Args:
          stacked: the nodes' adapters, stacked.
          batch: the evaluation batch.

        Returns:
          Each metric with one value per node.
        """
        return self._trainer.evaluate(stacked, batch, self._holder.frozen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


def attach(fleet: Any) -> LoraRound:
    """Turn a fleet into a LoRA fleet: its task, trainer and metrics work on adapters.

    The fleet's own code is unchanged: its trainer becomes a :class:`FrozenTrainer` and its
    metrics read the returned round's ``frozen`` (the base the coordinator sets before every
    fit and evaluation), and ``fleet.initial_params`` gives the base model (the run's initial
    params).

    Args:
      fleet: the :class:`meta_consensus.fleet.Fleet` (its task already checked against its data).

    Returns:
      The run's :class:`LoraRound`.
    """
    from meta_consensus.fleet import _trainer

    nd = fleet.cfg.nodes
    base_task = fleet.task
    run = LoraRound(fleet.cfg, wrap_task(fleet.cfg, base_task))
    fleet.task = run.task
    trainer = _trainer(run.task, nd.learning_rate, nd.batch_size, None, nd.optimizer)
    fleet.trainer = FrozenTrainer(trainer, run)
    metrics = lora_metrics(run.task)
    fleet._metrics = lambda params, batch: metrics(params, batch, run.frozen)
    fleet.initial_params = base_task.init
    return run


def describe(run: LoraRound) -> dict[str, Any]:
    """A LoRA run's settings and targets as an export needs them (JSON-safe).

    Args:
      run: the run's LoRA round.

    Returns:
      ``rank``, ``alpha``, ``scale``, ``dropout``, ``freeze_a``, ``targets`` (as configured),
      ``target_paths`` (every adapted kernel's '/'-joined path and shape) and
      ``target_modules`` (the module names of those kernels, PEFT's ``target_modules``), and the
      ``adapter_method``.
    """
    s = run.task.settings
    paths = run.task.targets
    modules = sorted({p.split("/")[-2] if p.endswith("/kernel") else p.split("/")[-1] for p in paths})
    return {
        "rank": s.rank,
        "alpha": s.alpha,
        "scale": s.scale,
        "dropout": s.dropout,
        "freeze_a": s.freeze_a,
        "targets": list(s.targets),
        "target_paths": {p: list(shape) for p, shape in paths.items()},
        "target_modules": modules,
        "adapter_method": run.cfg.vote.adapter_method,
    }


def base_digest(frozen: Mapping[str, Any]) -> str:
    """SHA-256 of the frozen part's bytes (dotted keys in order): two sides hold the same base.

    Args:
      frozen: the frozen part (``{"base", "a"}``).

    Returns:
      The hex digest.
    """
    import hashlib

    from consensus.io.keys import flatten

    h = hashlib.sha256()
    for key, leaf in sorted(flatten(dict(frozen)).items()):
        h.update(key.encode())
        h.update(np.ascontiguousarray(np.asarray(jax.device_get(leaf))).tobytes())
    return h.hexdigest()


_METRICS: dict[int, Any] = {}


def lora_metrics(task: LoraTask) -> Any:
    """One jitted ``metrics(params, batch, frozen)`` per LoRA task.

    Args:
      task: the LoRA task.

    Returns:
      The jitted function (built once per task object).
    """
    if id(task) not in _METRICS:
        _METRICS[id(task)] = jax.jit(lambda p, batch, frozen: task.metrics(p, batch, frozen=frozen))
    return _METRICS[id(task)]
