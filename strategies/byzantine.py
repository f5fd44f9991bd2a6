"""Byzantine nodes as node strategies, chosen by a node mask.

Honest and Byzantine nodes train in the same jitted step: a Byzantine node is
an ordinary node whose *data* is poisoned during training (a data attack:
label flipping, through the task's ``flip_labels``, or one a plug-in declares
with ``kind="data"``) and/or whose *submitted params* are
replaced after training by a model attack computed from the honest nodes'
updates (:mod:`strategies.attacks`: sign flip, ALIE, IPM, Gaussian, NaN/Inf,
mimic). Model attacks act on updates relative to the anchor (the last
consensus), the setting of the robust-aggregation literature.

Example::

    byz = Byzantine(mask=np.array([False, False, False, True]), attack="alie")
    state, submitted, log = byzantine_fit(trainer, state, data.own(), 100, byz, key, anchor=global_params)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from strategies import attacks
from strategies.tasks.base import NodeData, PyTree
from strategies.trainer import FitLog, NodeTrainer, TrainState

LABEL_FLIP = "label_flip"


@dataclasses.dataclass(frozen=True)
class Byzantine:
    """Which nodes are Byzantine and how they attack.

    Args:
      mask: concrete (n,) bool, True for Byzantine nodes.
      attack: a name from :data:`strategies.attacks.ATTACKS` (a data attack such as
        ``"label_flip"``: poisoned training data only; or an update attack), or an update
        attack function ``attack(key, honest_deltas, num_byzantine, **kw)``.
      label_flip: also train the Byzantine nodes on flipped labels when the
        attack is a model attack (data + model poisoning).
      kwargs: keyword arguments of the attack (``scale``, ``std``, ``epsilon``, ``z``, ...;
        a data attack's options).

    Attributes:
      data_attack: (derived) the data attack the poisoned nodes train under, bound to its
        options once (:func:`strategies.attacks.data_attack`), or None.

    Raises:
      TypeError: when ``mask`` is not a 1-D numpy bool array.
      ValueError: for an unknown attack name, a model attack with no honest node, or (from
        :func:`strategies.attacks.data_attack`) options that do not hash.
      consensus.specs.RegistryError: for options the data attack does not take.
    """

    mask: np.ndarray
    attack: str | Callable[..., PyTree] = LABEL_FLIP
    label_flip: bool = False
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_attack: attacks.DataAttack | None = dataclasses.field(init=False, default=None, compare=False)

    def __post_init__(self):
        mask = np.asarray(self.mask)
        if mask.ndim != 1 or mask.dtype != np.bool_:
            raise TypeError(
                f"Byzantine.mask must be a 1-D numpy bool array, got {mask.dtype} of shape {mask.shape}"
            )
        object.__setattr__(self, "mask", mask)
        if isinstance(self.attack, str) and self.attack not in attacks.ATTACKS:
            raise ValueError(
                f"unknown attack {self.attack!r}; valid: {sorted(attacks.ATTACKS)} or a function"
            )
        if self.is_model_attack and mask.all():
            raise ValueError(
                "a model attack needs at least one honest node (it is a function of their updates)"
            )
        if not self.is_model_attack:
            assert isinstance(self.attack, str)
            bound = attacks.data_attack(self.attack, self.kwargs)
        else:
            bound = attacks.data_attack(LABEL_FLIP) if self.label_flip else None
        object.__setattr__(self, "data_attack", bound)

    @property
    def num_byzantine(self) -> int:
        """The number of Byzantine nodes."""
        return int(self.mask.sum())

    @property
    def is_model_attack(self) -> bool:
        """The attack replaces the submitted update (a function, or a name declared ``kind="update"``)."""
        return not isinstance(self.attack, str) or attacks.ATTACKS[self.attack].kind == "update"

    @property
    def poisoned(self) -> np.ndarray:
        """(n,) bool: nodes that train under :attr:`data_attack` (a data attack, or ``label_flip`` set)."""
        if self.data_attack is not None:
            return self.mask.copy()
        return np.zeros_like(self.mask)

    @property
    def flip_mask(self) -> np.ndarray:
        """The :attr:`poisoned` mask (its name from when label flipping was the only data attack)."""
        return self.poisoned


def honest(num_nodes: int) -> Byzantine:
    """No Byzantine node.

    Args:
      num_nodes: n.

    Returns:
      A configuration with an all-False mask.
    """
    return Byzantine(np.zeros((num_nodes,), bool))


def last_nodes(
    num_nodes: int, num_byzantine: int, attack: str | Callable = LABEL_FLIP, **kwargs: Any
) -> Byzantine:
    """The last ``num_byzantine`` nodes are Byzantine (a common convention; masks are positional).

    Args:
      num_nodes: n.
      num_byzantine: f, with 0 <= f <= n.
      attack: the attack (see :class:`Byzantine`).
      **kwargs: the attack's keyword arguments.

    Returns:
      The configuration.

    Raises:
      ValueError: for f outside [0, n] (and as :class:`Byzantine` for the attack).
    """
    if not 0 <= num_byzantine <= num_nodes:
        raise ValueError(f"need 0 <= num_byzantine <= num_nodes, got {num_byzantine} of {num_nodes}")
    mask = np.zeros((num_nodes,), bool)
    mask[num_nodes - num_byzantine :] = True
    return Byzantine(mask, attack, kwargs=kwargs)


def submit(byz: Byzantine, key: jax.Array, stacked: PyTree, anchor: PyTree | None) -> PyTree:
    """The params every node hands to the coordinator: Byzantine rows replaced by the model attack.

    Args:
      byz: the Byzantine configuration.
      key: PRNG key of the attack.
      stacked: trained stacked params (n rows).
      anchor: the last consensus; attacks act on the updates ``x_i - anchor``
        (on raw params when None).

    Returns:
      The stacked params, unchanged for label flipping or with no Byzantine node.

    Raises:
      ValueError: when the mask's length is not the number of stacked nodes.
    """
    n = int(jax.tree_util.tree_leaves(stacked)[0].shape[0])
    if byz.mask.shape != (n,):
        raise ValueError(f"Byzantine mask has shape {byz.mask.shape}, the stacked params have {n} nodes")
    if not byz.is_model_attack or not byz.mask.any():
        return stacked
    try:
        fn = _compiled_attack(byz.attack, tuple(byz.mask.tolist()), tuple(sorted(byz.kwargs.items())))
    except TypeError:  # unhashable attack options: run eagerly
        return attacks.apply_attack(byz.attack, key, stacked, byz.mask, params=anchor, **dict(byz.kwargs))
    return fn(key, stacked, anchor)


@functools.lru_cache(maxsize=64)
def _compiled_attack(attack: Any, mask: tuple[bool, ...], kwargs: tuple[tuple[str, Any], ...]) -> Callable:
    # One compiled program per (attack, mask, options) instead of many small eager ops per leaf.
    mask_np = np.array(mask, bool)

    def run(key, stacked, anchor):
        return attacks.apply_attack(attack, key, stacked, mask_np, params=anchor, **dict(kwargs))

    return jax.jit(run)


def byzantine_fit(
    trainer: NodeTrainer,
    state: TrainState,
    data: NodeData | Sequence[NodeData],
    steps: int,
    byz: Byzantine,
    key: jax.Array,
    *,
    anchor: PyTree | None = None,
    **fit_kwargs: Any,
) -> tuple[TrainState, PyTree, FitLog]:
    """Train honest and Byzantine nodes together, then form what each node submits.

    Args:
      trainer: the node trainer.
      state: the nodes' training state (as :meth:`NodeTrainer.fit`).
      data: the nodes' data (as :meth:`NodeTrainer.fit`).
      steps: the local steps (as :meth:`NodeTrainer.fit`).
      byz: the Byzantine configuration (mask over all n nodes).
      key: PRNG key of the model attack.
      anchor: the last consensus (the reference of model attacks).
      **fit_kwargs: passed to :meth:`NodeTrainer.fit` (``schedule``,
        ``hyperparams``, ``proximal``, ``record``).

    Returns:
      ``(state, submitted, log)``: the trained state (Byzantine nodes keep
      training honestly-shaped params), the stacked params submitted to the
      coordinator, and the fit log.

    Raises:
      ValueError: when the mask's length is not the number of nodes in ``state``.
      TypeError: when ``fit_kwargs`` carries a data attack (``flip_labels``, ``poisoned``,
        ``data_attack``): those come from ``byz``.
    """
    n = int(state.step.shape[0])
    if byz.mask.shape != (n,):
        raise ValueError(f"Byzantine mask has shape {byz.mask.shape}, the state has {n} nodes")
    given = sorted({"flip_labels", "poisoned", "data_attack"} & set(fit_kwargs))
    if given:
        raise TypeError(f"pass data attacks through the Byzantine configuration, not {given}")
    poisoned = byz.poisoned
    state, log = trainer.fit(
        state,
        data,
        steps,
        poisoned=poisoned if poisoned.any() else None,
        data_attack=byz.data_attack,
        **fit_kwargs,
    )
    return state, submit(byz, key, state.params, anchor), log
