"""Buffered asynchronous rounds (FedBuff) on a virtual clock, in one process.

``[schedule] mode = "async"`` (see :class:`~meta_consensus.config.ScheduleConfig`): nodes train
from the consensus version they were sent and the coordinator merges whenever ``buffer`` = K
updates have arrived, instead of waiting for every node (Nguyen et al., "Federated Learning with
Buffered Asynchronous Aggregation", AISTATS 2022).

**The clock.** Every fit of node i takes a virtual time from :class:`SpeedModel` (a node's mean
from the named distribution, times a per-fit jitter drawn from ``(seed, node, fit count)``, so
it needs no generator state). A node sent version v at time t arrives at t + its fit's time;
arrivals are taken in time order (ties by node index).

**Staleness** is tau = the current version - the version *the coordinator recorded when it sent
the node its model* (:attr:`AsyncState.sent`); nothing a node says about itself enters it. An
update more than ``max_staleness`` versions old is dropped (counted in ``RoundInfo.dropped``) and
its node is sent the current version at once; a node whose fit failed (a simulated crash or drop)
is sent it again too, so a crashed or slow node never blocks a merge.

**An applied buffer** goes through the same stages as a synchronous round
(:mod:`meta_consensus.stages`: validate -> vote -> weights -> DP -> accept -> evaluate). Its
candidates are the current consensus plus each update's delta (its trained params minus the
version it was sent) scaled by the staleness weight s(tau), so the vote, the weights and DP's
clipping all see the buffer's (discounted) deltas around the current consensus, and the merge
``sum_i w_i (x + s_i d_i) = x + sum_i w_i s_i d_i`` is FedBuff's update with the vote's and the
weights' w (which sum to 1 over the accepted updates): staleness shrinks the step, it is not
normalised away. Node-level DP charges one event per applied buffer. The nodes of an applied
buffer wait for the new version and are sent it when the next round starts; a failed buffer is
discarded (its nodes are sent the current version again).

In-flight fits are computed when a node is sent its model (the result depends only on the
node's own state, the version and its key), so the state holds every in-flight delta, its
version and its arrival time; checkpoints keep them with the clock, and a resumed run continues
bit for bit.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus.mesh import to_host
from meta_consensus import stages
from meta_consensus.config import Config, ConfigError, ScheduleConfig
from meta_consensus.fleet import FleetOutput
from meta_consensus.fleet import _to_host as nodes_to_host
from meta_consensus.sampling import ClientSample

if TYPE_CHECKING:
    from meta_consensus.coordinator import Coordinator, CoordinatorState, RoundInfo

PyTree = Any

SPEED_STREAM = 0x5BEED  # the speed model's seed stream next to the run's seed
DISPATCH_STREAM = 0xD15  # fold_in tag of the dispatch keys (the k-th dispatch: fold_in(tag key, k))


def staleness_weight(schedule: ScheduleConfig, tau: np.ndarray | list[int]) -> np.ndarray:
    """The weight s(tau) of updates ``tau`` versions old.

    Args:
      schedule: the ``[schedule]`` config (``staleness``, its exponent and hinge).
      tau: staleness values (>= 0).

    Returns:
      float64 weights in (0, 1]: 1 ("constant"), (1 + tau)^-a ("polynomial"), or 1 up to the
      hinge b and 1 / (1 + a (tau - b)) beyond it ("hinge").

    Raises:
      ValueError: a negative staleness.
    """
    t = np.asarray(tau, np.float64)
    if (t < 0).any():
        raise ValueError(f"staleness must be >= 0, got {t.min()}")
    a = float(schedule.staleness_exponent)
    if schedule.staleness == "constant":
        return np.ones_like(t)
    if schedule.staleness == "polynomial":
        return (1.0 + t) ** -a
    b = float(schedule.staleness_hinge)
    return np.where(t <= b, 1.0, 1.0 / (1.0 + a * np.maximum(t - b, 0.0)))


def staleness(sent: np.ndarray, version: int, node: int, reported: int | None = None) -> int:
    """The staleness tau of ``node``'s update: the current version minus the version it was sent.

    The version is the coordinator's own record (``sent``). A node's claim about the version it
    trained from (``reported``, as a deployment's reply may carry one) is never used: a node
    that claims a fresher version than it was sent gains no weight.

    Args:
      sent: (n,) the version the coordinator sent each node (-1: none).
      version: the current version.
      node: the node whose update arrived.
      reported: the version the node claims (ignored).

    Returns:
      tau >= 0.

    Raises:
      ValueError: an update from a node that was not sent a version.
    """
    del reported  # the node's word about its own staleness is not evidence
    v = int(sent[node])
    if v < 0:
        raise ValueError(f"node {node} was not sent a version: its update cannot be placed")
    return int(version) - v


class SpeedModel:
    """How long each fit of each node takes on the virtual clock.

    Args:
      cfg: the run config (``seed``, ``nodes.count``, ``[schedule]``).

    Raises:
      ConfigError: a trace file that cannot be read or has too few lines.
    """

    def __init__(self, cfg: Config):
        s, n = cfg.schedule, cfg.nodes.count
        self.seed, self.jitter = int(cfg.seed), float(s.speed_jitter)
        self.trace: list[np.ndarray] | None = None
        self._sync: list[float] = []
        if s.speeds == "trace":
            self.trace = _read_trace(Path(str(s.speed_trace)), n)
            self.means = np.asarray([float(np.mean(t)) for t in self.trace])
        elif s.speeds == "constant":  # every fit takes 1, without jitter
            self.means, self.jitter = np.ones((n,)), 0.0
        else:
            self.means = lognormal_means(n, float(s.speed_spread), self.seed)

    def duration(self, node: int, fit: int) -> float:
        """The virtual time of node ``node``'s fit number ``fit`` (0 first).

        Args:
          node: the node.
          fit: how many fits the node made before this one.

        Returns:
          The time (> 0).
        """
        if self.trace is not None:
            t = self.trace[node]
            return float(t[fit % len(t)])
        if self.jitter == 0:
            return float(self.means[node])
        z = np.random.default_rng([self.seed, SPEED_STREAM, node, fit]).standard_normal()
        return float(self.means[node] * math.exp(self.jitter * z))

    def sync_clock(self, round_index: int) -> float:
        """The virtual time at the end of synchronous round ``round_index``: each round waits for its slowest.

        Every node fits once per round (its fit number is the round's index).

        Args:
          round_index: the round (0-based).

        Returns:
          The sum over rounds 0..round_index of the slowest node's fit time.
        """
        n = len(self.means)
        while len(self._sync) <= round_index:  # cumulative, computed once per round index
            r = len(self._sync)
            slowest = max(self.duration(i, r) for i in range(n))
            self._sync.append((self._sync[-1] if self._sync else 0.0) + slowest)
        return self._sync[round_index]


def lognormal_means(n: int, spread: float, seed: int) -> np.ndarray:
    """Each node's mean fit time: log-normal quantiles, the slowest ``spread`` times the fastest.

    The logs are the standard normal's quantiles at (i + 0.5) / n, scaled so that the largest
    over the smallest is ``spread`` and their mean is 0 (geometric mean 1), in an order drawn
    from ``seed`` (which node is slow does not follow its index).

    Args:
      n: the nodes.
      spread: slowest / fastest (>= 1).
      seed: the run's seed.

    Returns:
      (n,) float64 mean times.
    """
    z = np.asarray([statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    width = float(z.max() - z.min())
    sigma = math.log(spread) / width if width > 0 else 0.0
    order = np.random.default_rng([seed, SPEED_STREAM]).permutation(n)
    return np.exp(sigma * z[order])


def _read_trace(path: Path, n: int) -> list[np.ndarray]:
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        rows = [np.asarray([float(x) for x in ln.replace(",", " ").split()], np.float64) for ln in lines]
    except (OSError, ValueError) as e:
        raise ConfigError(f"schedule.speed_trace = {str(path)!r}: {e}") from None
    if len(rows) < n or any(len(r) == 0 or (r <= 0).any() for r in rows[:n]):
        raise ConfigError(
            f"schedule.speed_trace = {str(path)!r} needs one line of positive fit times per node "
            f"({n} lines), got {len(rows)}"
        )
    return rows[:n]


class AsyncState(NamedTuple):
    """The asynchronous schedule's part of the run's state (checkpointed whole).

    Attributes:
      clock: the virtual time.
      version: the consensus version (applied buffers).
      dispatches: fit calls made so far (the next one's key is ``fold_in(dispatch key, dispatches)``).
      sent: (n,) int64, the version the coordinator sent each node (-1: waiting to be sent one).
      arrival: (n,) float64, when each in-flight fit arrives (inf: not in flight).
      fits: (n,) int64, fits each node was sent (its speed model's fit number).
      deltas: stacked (n, ...) float32 host arrays: each in-flight fit's params minus its version.
      loss: (n,) float64, each in-flight fit's mean training loss.
      answered: (n,) bool, whether each in-flight fit will arrive with an answer.
      dropped: updates dropped for staleness so far.
    """

    clock: float
    version: int
    dispatches: int
    sent: np.ndarray
    arrival: np.ndarray
    fits: np.ndarray
    deltas: PyTree
    loss: np.ndarray
    answered: np.ndarray
    dropped: int

    def meta(self) -> dict[str, Any]:
        """The JSON-safe part (everything but the deltas), as a checkpoint stores it.

        Returns:
          A dict of numbers and lists (floats kept exactly by their hex form).
        """
        return {
            "clock": float.hex(float(self.clock)),
            "version": int(self.version),
            "dispatches": int(self.dispatches),
            "sent": [int(x) for x in self.sent],
            "arrival": [float.hex(float(x)) for x in self.arrival],
            "fits": [int(x) for x in self.fits],
            "loss": [float.hex(float(x)) for x in self.loss],
            "answered": [bool(x) for x in self.answered],
            "dropped": int(self.dropped),
        }

    @staticmethod
    def from_meta(meta: dict[str, Any], deltas: PyTree) -> AsyncState:
        """The state that :meth:`meta` and the saved deltas describe.

        Args:
          meta: :meth:`meta`'s dict.
          deltas: the stacked deltas (host arrays).

        Returns:
          The state.
        """
        return AsyncState(
            clock=float.fromhex(meta["clock"]),
            version=int(meta["version"]),
            dispatches=int(meta["dispatches"]),
            sent=np.asarray(meta["sent"], np.int64),
            arrival=np.asarray([float.fromhex(x) for x in meta["arrival"]], np.float64),
            fits=np.asarray(meta["fits"], np.int64),
            deltas=jax.tree.map(np.asarray, deltas),
            loss=np.asarray([float.fromhex(x) for x in meta["loss"]], np.float64),
            answered=np.asarray(meta["answered"], bool),
            dropped=int(meta["dropped"]),
        )


class AsyncSchedule:
    """The buffered asynchronous schedule of a coordinator (see the module docstring).

    Args:
      co: the coordinator (its fleet trains the nodes; its stages merge the buffers).

    Raises:
      ConfigError: a run over several processes.
    """

    def __init__(self, co: Coordinator):
        if jax.process_count() > 1:
            raise ConfigError("schedule.mode = 'async' runs in one process (no jax.distributed)")
        self.cfg = co.cfg.schedule
        self.n = co.cfg.nodes.count
        self.speeds = SpeedModel(co.cfg)

    def init(self, co: Coordinator, state: CoordinatorState) -> CoordinatorState:
        """The initial state: the nodes' state on the host, every node waiting for version 0.

        Args:
          co: the coordinator.
          state: the synchronous initial state.

        Returns:
          The state with its :class:`AsyncState`.
        """
        nodes = state.nodes
        if jnp.issubdtype(nodes.key.dtype, jax.dtypes.prng_key):
            # The fleet's host rows keep raw key data; it wraps them back with this impl.
            co.fleet._key_impl = jax.random.key_impl(nodes.key)
        n = self.n
        deltas = jax.tree.map(lambda p: np.zeros((n, *np.shape(p)), np.float32), to_host(state.consensus))
        s = AsyncState(
            clock=0.0,
            version=0,
            dispatches=0,
            sent=np.full((n,), -1, np.int64),
            arrival=np.full((n,), np.inf),
            fits=np.zeros((n,), np.int64),
            deltas=deltas,
            loss=np.full((n,), np.nan),
            answered=np.zeros((n,), bool),
            dropped=0,
        )
        return state._replace(nodes=nodes_to_host(nodes), schedule=s)

    # ------------------------------------------------------------------ sending

    def _send(
        self, co: Coordinator, state: CoordinatorState, s: AsyncState, ids: np.ndarray
    ) -> tuple[CoordinatorState, AsyncState, dict[int, str], float]:
        """Send ``ids`` the current version: fit them now, record their deltas, versions and arrivals."""
        ids = np.asarray(ids, np.int64)
        chunk = co.fleet.cfg.nodes.chunk_size()  # a buffer's worth (the coordinator sets the fleet's)
        slots = max(math.ceil(len(ids) / chunk), 1) * chunk
        sample = ClientSample(np.concatenate([ids, np.full((slots - len(ids),), -1, np.int64)]), self.n)
        root = jax.random.wrap_key_data(jnp.asarray(state.key))
        key = jax.random.fold_in(jax.random.fold_in(root, DISPATCH_STREAM), s.dispatches)
        out = co.fleet.fit_sample(state.nodes, state.consensus, key, sample)
        k = len(ids)
        anchor = to_host(state.consensus)
        submitted = to_host(out.submitted)

        def put(old, sub, a):
            new = np.array(old, copy=True)
            new[ids] = np.asarray(sub[:k], np.float32) - np.asarray(a, np.float32)
            return new

        deltas = jax.tree.map(put, s.deltas, submitted, anchor)
        arrival, fits = s.arrival.copy(), s.fits.copy()
        for i in ids:
            arrival[i] = s.clock + self.speeds.duration(int(i), int(fits[i]))
            fits[i] += 1
        sent, loss, answered = s.sent.copy(), s.loss.copy(), s.answered.copy()
        sent[ids] = s.version
        loss[ids] = np.asarray(out.loss[:k], np.float64)
        answered[ids] = out.answered[:k]
        errors = {int(ids[j]): e for j, e in out.errors.items() if j < k}
        s = s._replace(
            dispatches=s.dispatches + 1,
            sent=sent,
            arrival=arrival,
            fits=fits,
            deltas=deltas,
            loss=loss,
            answered=answered,
        )
        return state._replace(nodes=out.state), s, errors, out.seconds

    # ------------------------------------------------------------------ a round

    def round(
        self, co: Coordinator, state: CoordinatorState, *, attempt: int = 0, evaluate: bool | None = None
    ) -> tuple[CoordinatorState, RoundInfo]:
        """Fill a buffer on the virtual clock and apply it through the round's stages.

        Args:
          co: the coordinator.
          state: the run's state (with its :class:`AsyncState`).
          attempt: the attempt at this applied buffer (a failed buffer is discarded; the retry
            fills the next one).
          evaluate: evaluate the consensus (default: as a synchronous round).

        Returns:
          The new state and the buffer's info; on failure the consensus is unchanged but the
          clock, the in-flight fits and the dropped count have moved on.
        """
        s = state.schedule
        assert isinstance(s, AsyncState)
        K = self.cfg.buffer
        fit_secs = 0.0
        errors: dict[int, str] = {}
        waiting = np.flatnonzero(s.sent < 0)
        if waiting.size:  # the last buffer's nodes (all of them at the start) get the current version
            state, s, errs, secs = self._send(co, state, s, waiting)
            errors.update(errs)
            fit_secs += secs
        buffer: list[int] = []
        taus: list[int] = []
        versions: list[int] = []
        dropped = 0
        events = 0
        while len(buffer) < K and np.isfinite(s.arrival).any() and events < 4 * self.n + K:
            events += 1
            order = np.lexsort((np.arange(self.n), s.arrival))
            i = int(order[0])
            arrival = s.arrival.copy()
            arrival[i] = np.inf
            tau = staleness(s.sent, s.version, i)
            s = s._replace(clock=float(s.arrival[i]), arrival=arrival)
            why = ""
            if not s.answered[i]:
                why = errors.get(i, "no answer")
            elif self.cfg.max_staleness is not None and tau > self.cfg.max_staleness:
                why = f"dropped: {tau} versions old, max_staleness = {self.cfg.max_staleness}"
                dropped += 1
            if why:
                errors[i] = why
                state, s, errs, secs = self._send(co, state, s, np.asarray([i]))
                errors.update(errs)
                fit_secs += secs
                continue
            errors.pop(i, None)
            buffer.append(i)
            taus.append(tau)
            versions.append(int(s.sent[i]))
        s = s._replace(dropped=s.dropped + dropped)
        ids = np.asarray(buffer, np.int64)
        sent = s.sent.copy()
        sent[ids] = -1  # the buffer's nodes wait for the next version
        after = s._replace(sent=sent)
        w = stages.start(co, state, attempt, evaluate, sample=ClientSample(ids, self.n))
        w.asked = K
        w.out = self._buffer_output(co, state, s, ids, taus, errors, fit_secs)
        why = stages.validate(co, w)
        assert w.info is not None
        info = w.info
        info.virtual_time, info.versions, info.staleness, info.dropped = s.clock, versions, taus, dropped
        for i, e in errors.items():  # failed or dropped fits: not in the buffer's slots
            info.errors.setdefault(str(i), e)
        if not why:
            why = stages.merge(co, w)
            charged = False
            if not why:
                why, charged = stages.accept(co, w), True
        else:
            charged = False
        if why:
            failed, info = stages.fail(w, why, charged=charged)
            return failed._replace(schedule=after), info
        stages.baseline(co, w)
        stages.evaluate(co, w)
        new_state, info = stages.finish(co, w, state.nodes)
        return new_state._replace(schedule=after._replace(version=s.version + 1)), info

    def _buffer_output(
        self,
        co: Coordinator,
        state: CoordinatorState,
        s: AsyncState,
        ids: np.ndarray,
        taus: list[int],
        errors: dict[int, str],
        fit_secs: float,
    ) -> FleetOutput:
        """The buffer as the round's answers: the consensus plus each update's discounted delta."""
        scale = staleness_weight(self.cfg, taus).astype(np.float32)
        if len(ids):
            submitted = jax.tree.map(
                lambda x, d: jnp.asarray(
                    np.asarray(x, np.float32)[None]
                    + scale.reshape((-1,) + (1,) * np.ndim(x)) * np.asarray(d)[ids],
                    dtype=jnp.asarray(x).dtype,
                ),
                to_host(state.consensus),
                s.deltas,
            )
        else:  # nothing arrived (every node failed): one row that the vote never sees
            submitted = co.fleet.trainer_broadcast(state.consensus, 1)
            ids = np.asarray([-1], np.int64)
        real = ids >= 0
        return FleetOutput(
            state=state.nodes,
            submitted=submitted,
            answered=real.copy(),
            errors={},
            loss=np.where(real, s.loss[np.maximum(ids, 0)], np.nan),
            seconds=fit_secs,
            ids=ids,
        )
