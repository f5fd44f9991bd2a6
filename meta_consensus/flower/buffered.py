"""Buffered asynchronous rounds on Flower's deployment engine (``[schedule] mode = "async"``).

The in-process schedule (:mod:`meta_consensus.async_rounds`) on a virtual clock; here the clock
is real and the nodes are SuperNodes, driven through the Message API:

* **push as nodes become free.** Every connected node is sent the current consensus and the
  version number the strategy records for that message (a ``train`` message, as in a
  synchronous round, whose ``server-round`` is the version). A node is free when it has no
  message in flight and no update waiting in the current buffer.
* **pull as replies arrive.** Every ``poll_s`` the driver pulls the replies of the messages in
  flight (``grid.pull_messages``) and takes those that are there, in the order they come.
  An update's staleness is tau = the current version minus the version *the strategy sent
  with that message* (looked up by the reply's ``reply_to`` message id,
  :func:`~meta_consensus.async_rounds.staleness`): what a node reports about its round is
  never used. An update more than ``max_staleness`` versions old is dropped and counted.
  A node the SuperLink stops listing, an error reply and a message with no reply within
  ``timeout_s`` are missing answers (filed under the partition); a node still listed is
  sent the current version again.
* **apply the buffer** when K = ``schedule.buffer`` updates have arrived: its candidates are
  the current consensus plus each update's delta (its candidate minus the version it was
  sent) scaled by the staleness weight s(tau), and they go through the strategy's merge (the
  vote on the buffer's K rows, the weights, DP with one ledger event per applied buffer), as
  in-process. A buffer's nodes are sent the new version once it is applied, so a node
  contributes at most one update to a buffer; a slow node never holds a merge up.

A merge that fails (the vote's precondition, the acceptance threshold, the solver) keeps the
consensus and discards the buffer; its nodes are sent the current version again. The run ends
after ``rounds`` applied buffers (failed ones included, as a synchronous run counts failed
rounds), or when the strategy stops (the privacy budget), or when no node is connected and
nothing is in flight for ``wait_for_nodes_s``. Messages still in flight then are abandoned.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from consensus import tree
from consensus.mesh import to_host
from meta_consensus.async_rounds import staleness, staleness_weight
from meta_consensus.coordinator import too_few_answers
from meta_consensus.flower.arrays import ArrayRecordMismatch, from_array_record, to_array_record
from meta_consensus.flower.node import CONFIG_KEY, PARTITION_KEY, ROUND_KEY
from meta_consensus.flower.strategy import ConsensusStrategy, FlowerRound, error_text

PyTree = Any
log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Update:
    """One arrived update: its partition, the version it was sent, its staleness and candidate."""

    partition: int
    node_id: int
    version: int
    tau: int
    candidate: PyTree


class BufferedRun:
    """Buffered asynchronous rounds of ``strategy`` on ``grid`` (see the module docstring).

    Args:
      strategy: the strategy whose config (``[schedule]``), consensus, merge and ledger are used.
      grid: the Grid Flower gives the ServerApp (or :class:`~meta_consensus.flower.local.InProcessGrid`).
      timeout_s: seconds a message may stay without a reply before it is a missing answer.
      poll_s: seconds between two pulls of the replies in flight.

    Raises:
      ValueError: a strategy whose config is not in async mode.
    """

    def __init__(
        self, strategy: ConsensusStrategy, grid: Grid, *, timeout_s: float = 600.0, poll_s: float = 0.5
    ):
        if not strategy.cfg.schedule.asynchronous:
            raise ValueError("BufferedRun needs schedule.mode = 'async' in the strategy's config")
        self.strategy = strategy
        self.grid = grid
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)
        self.schedule = strategy.cfg.schedule
        self.version = 0
        self.anchors: dict[int, PyTree] = {0: to_host(strategy.consensus)}  # version -> consensus sent
        self.inflight: dict[str, tuple[int, int, float]] = {}  # message id -> (node id, version, sent at)
        self.buffer: list[_Update] = []
        self.errors: dict[str, str] = {}  # since the last applied buffer, by partition
        self.dropped = 0

    # ------------------------------------------------------------------ sending

    def _partition(self, node_id: int) -> int | None:
        return self.strategy._partition_of.get(node_id)

    def _busy(self) -> set[int]:
        waiting = {u.node_id for u in self.buffer}
        return waiting | {node for node, _, _ in self.inflight.values()}

    def _dispatch(self, online: list[int]) -> None:
        """Send the current version to every online node that is free."""
        st = self.strategy
        new = [i for i in online if i not in st._partition_of]
        if new:
            st._learn_partitions(self.version, self.grid, new)
        busy = self._busy()
        # One node per partition: a second node that says it serves a partition is not sent work
        # (its updates would count twice in a buffer).
        owner: dict[int, int] = {}
        for i in sorted(online):
            pid = self._partition(i)
            if pid is not None and owner.setdefault(pid, i) != i:
                self.errors[f"node {i}"] = f"says it serves partition {pid}, which node {owner[pid]} serves"
        free = [
            i for i in online if i not in busy and (p := self._partition(i)) is not None and owner[p] == i
        ]
        if not free or st.stopped:
            return
        config = ConfigRecord({ROUND_KEY: self.version, CONFIG_KEY: st.config_text})
        content = RecordDict({"arrays": to_array_record(st.consensus), "config": config})
        messages = [Message(content, dst, MessageType.TRAIN, group_id=f"v{self.version}") for dst in free]
        ids = list(self.grid.push_messages(messages))
        now = time.monotonic()
        if len(ids) != len(messages):  # HttpGrid returns [] for a payload too large (and logs it)
            ids = [""] * len(messages)
        for msg, mid in zip(messages, ids, strict=True):
            dst = msg.metadata.dst_node_id
            if mid:
                self.inflight[mid] = (dst, self.version, now)
            else:
                self.errors[str(self._partition(dst))] = "not sent: the SuperLink refused the message"

    # ------------------------------------------------------------------ receiving

    def _receive(self, reply: Message) -> None:
        """File one reply: an update into the buffer, or a missing answer with its reason."""
        mid = reply.metadata.reply_to_message_id
        if mid not in self.inflight:
            return  # a reply to a message given up on: too late
        node, sent_version, _ = self.inflight.pop(mid)
        pid = self._partition(node)
        key = str(pid) if pid is not None else f"node {node}"
        if reply.has_error():
            self.errors[key] = error_text(reply)
            return
        try:
            # flwr types a record value as any record's value: one that is no number raises, caught below.
            said = int(reply.content["metrics"][PARTITION_KEY])  # type: ignore[arg-type]
            what = f"node {pid}'s update"
            candidate = from_array_record(reply.content["arrays"], self.strategy.consensus, what)
        except (KeyError, TypeError, ValueError, ArrayRecordMismatch) as e:
            self.errors[key] = f"unusable reply: {e}"
            return
        if said != pid:
            self.errors[key] = f"the reply says partition {said}, the node serves partition {pid}"
            return
        # The version is the one this message carried, by the strategy's record; the node's word
        # about its round (the reply's server-round) is not used.
        tau = staleness(np.asarray([sent_version]), self.version, 0)
        limit = self.schedule.max_staleness
        if limit is not None and tau > limit:
            self.dropped += 1
            self.errors[key] = f"dropped: {tau} versions old, max_staleness = {limit}"
            return
        assert pid is not None  # a message goes only to a node whose partition is known
        self.buffer.append(_Update(pid, node, sent_version, tau, candidate))
        self.errors.pop(key, None)

    def _expire(self, online: set[int]) -> None:
        """Give up on messages to nodes the SuperLink no longer lists, or without a reply in time."""
        now = time.monotonic()
        for mid, (node, _, sent_at) in list(self.inflight.items()):
            gone = node not in online
            if gone or now - sent_at > self.timeout_s:
                del self.inflight[mid]
                pid = self._partition(node)
                self.errors[str(pid) if pid is not None else f"node {node}"] = (
                    "no reply: node went offline (the SuperLink no longer lists it)"
                    if gone
                    else f"no reply within {self.timeout_s:g} s"
                )

    # ------------------------------------------------------------------ a buffer

    def _apply(self) -> FlowerRound:
        """Merge the buffer's K updates (the strategy's merge) and record it as one round."""
        st, n, t0 = self.strategy, self.strategy.n, time.perf_counter()
        ups, self.buffer = self.buffer, []
        k = len(ups)
        scale = staleness_weight(self.schedule, [u.tau for u in ups]).astype(np.float32)
        x = to_host(st.consensus)
        rows = [
            jax.tree.map(
                lambda c, a, p, s=s: (np.asarray(p, np.float32) + s * (np.asarray(c, np.float32) - a)).astype(
                    np.asarray(p).dtype
                ),
                u.candidate,
                self.anchors[u.version],
                x,
            )
            for u, s in zip(ups, scale, strict=True)
        ]
        stacked = tree.stack([jax.tree.map(jnp.asarray, r) for r in rows])
        valid = np.asarray(to_host(tree.finite_mask(stacked)), bool)
        errors = dict(self.errors)
        for j in np.flatnonzero(~valid):
            errors[str(ups[j].partition)] = "non-finite candidate"
        answered = np.zeros((n,), bool)
        answered[[u.partition for u in ups]] = True
        valid_n = np.zeros((n,), bool)
        valid_n[[u.partition for u, v in zip(ups, valid, strict=True) if v]] = True
        eps = st.ledger.epsilon() if st.ledger is not None else 0.0
        info = FlowerRound(
            st.rounds_done + 1,
            True,
            "",
            answered.tolist(),
            valid_n.tolist(),
            [False] * n,
            [0.0] * n,
            errors,
            eps,
        )
        info.buffer = [u.partition for u in ups]
        info.versions = [u.version for u in ups]
        info.staleness = [u.tau for u in ups]
        info.dropped, self.dropped, self.errors = self.dropped, 0, {}
        why = st.stopped or too_few_answers(st.cfg, valid, k)
        merged = None
        if not why:
            rows_info = dataclasses.replace(info, accepted=[False] * k, weights=[0.0] * k)
            merged, why = st._merge(stacked, valid, rows_info, asked=k)
            info.epsilon, info.noise_std = rows_info.epsilon, rows_info.noise_std
            for u, a, w in zip(ups, rows_info.accepted, rows_info.weights, strict=True):
                info.accepted[u.partition], info.weights[u.partition] = bool(a), float(w)
        if why:
            info.ok, info.reason = False, why
            log.warning("buffer %d failed: %s (the previous consensus stays)", info.server_round, why)
        else:
            st.consensus = merged
            info.consensus_accuracy = float(to_host(st._metrics(merged, st.test))["accuracy"])
            info.heldout_accuracy = float(to_host(st._metrics(merged, st.heldout))["accuracy"])
            self.version += 1
            self.anchors[self.version] = to_host(merged)
        st.rounds_done += 1
        info.seconds = time.perf_counter() - t0
        st.history.append(info)
        # Versions no message in flight refers to are not needed any more.
        live = {v for _, v, _ in self.inflight.values()} | {self.version}
        self.anchors = {v: a for v, a in self.anchors.items() if v in live}
        return info

    # ------------------------------------------------------------------ the run

    def run(self, num_buffers: int) -> list[FlowerRound]:
        """Run until ``num_buffers`` buffers were applied (or the strategy stops, or no node is left).

        Args:
          num_buffers: how many buffers to apply (the config's ``rounds``).

        Returns:
          The applied buffers' records (also appended to the strategy's ``history``).
        """
        st, k = self.strategy, self.schedule.buffer
        out: list[FlowerRound] = []
        online = st._node_ids(self.grid, first=True)
        idle_since = time.monotonic()
        while len(out) < num_buffers and not st.stopped:
            self._dispatch(online)
            got = list(self.grid.pull_messages(list(self.inflight))) if self.inflight else []
            for reply in got:
                self._receive(reply)
                if len(self.buffer) >= k:
                    out.append(self._apply())
                    if len(out) >= num_buffers:
                        break
            online = sorted(self.grid.get_node_ids())
            self._expire(set(online))
            if self.inflight or online:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > st.wait_for_nodes_s:
                log.warning("no node connected and nothing in flight for %g s: stopping", st.wait_for_nodes_s)
                break
            if not got:
                time.sleep(self.poll_s)
        self.inflight.clear()  # abandoned: their replies, if any, are never pulled
        return out
