"""The quick path: a Flower ``Grid`` that runs a ClientApp's nodes in this process.

:class:`InProcessGrid` implements Flower's Grid interface (``get_node_ids``,
``push_messages``, ``pull_messages``, ``send_and_receive``) by calling the ClientApp for each
message as it is pushed (its reply waits for the pull), with one
:class:`flwr.app.Context` per node kept across rounds (``node_config`` holds
``partition-id`` and ``num-partitions``, as a SuperNode's does). A ClientApp that raises
becomes an error reply, as on a SuperNode; :meth:`InProcessGrid.kill` makes a node stop
answering (its messages get no reply), like a SuperNode that died.

Flower's own simulation engine (``flwr run`` against a SuperLink in simulation mode; see
docs/flower.md and tests/system/test_flower_simulation.py) needs Ray (``flwr[simulation]``,
the ``flower-simulation`` extra); this grid needs nothing beyond ``flwr`` and runs the same
ServerApp strategy and ClientApp code, one node after the other, in this process.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from meta_consensus.flower.node import PARTITION_KEY


class InProcessGrid(Grid):
    """``num_nodes`` nodes of ``client_app`` in this process (see the module docstring).

    Args:
      client_app: the ClientApp every node runs (:func:`~meta_consensus.flower.node.make_client_app`).
      num_nodes: how many nodes; node i has ``partition-id = i`` and Flower node id ``1000 + i``.
      run_config: the run config every node's Context holds (Flower's ``run_config``).
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict | None = None):
        self.client_app = client_app
        self._run: Run | None = None
        # Messages read this process's task identity, which a ServerApp process gets from the SuperLink.
        for name, value in (("run_id", 1), ("node_id", 0), ("task_id", 0)):
            if getattr(TaskIdentity, f"_{name}") is None:
                setattr(TaskIdentity, name, value)
        self.contexts: dict[int, Context] = {}
        for i in range(num_nodes):
            node_id = 1000 + i  # Flower node ids are opaque; partitions are what identifies a node
            self.contexts[node_id] = Context(
                run_id=1,
                node_id=node_id,
                node_config={PARTITION_KEY: i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
        self.dead: set[int] = set()
        self._replies: dict[str, Message] = {}  # pushed message id -> its node's reply

    def kill(self, partition: int) -> None:
        """Node ``partition`` stops answering (and leaves the node list), like a SuperNode that died.

        Args:
          partition: the node's partition id.
        """
        self.dead.add(1000 + partition)

    # ------------------------------------------------------------------ Grid

    def set_run(self, run: Run) -> None:
        """Keep the run Flower starts (the grid has no SuperLink to register it with)."""
        self._run = run

    @property
    def run(self):
        """The run :meth:`set_run` was given (None before)."""
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        """A Message to node ``dst_node_id``, as Flower's Grid makes it (arguments as Flower's)."""
        return Message(content, dst_node_id, message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The Flower node ids of the nodes still alive (not :meth:`kill` ed)."""
        return [i for i in self.contexts if i not in self.dead]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message's node now (one after the other); its reply waits for ``pull_messages``.

        Args:
          messages: the messages; each gets a fresh message id.

        Returns:
          The message ids, in order (a dead node's message gets one too, and never a reply).
        """
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid  # as HttpGrid.push_messages sets it (flwr 1.42)
            reply = self._answer(msg)
            if reply is not None:
                self._replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies waiting for ``message_ids`` (each handed out once).

        Args:
          message_ids: ids :meth:`push_messages` returned.

        Returns:
          The replies that are there (none for a dead node's message).
        """
        return [self._replies.pop(mid) for mid in message_ids if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Run each message's node now and return the replies (none for a dead node).

        Args:
          messages: the messages.
          timeout: unused: every node answers at once, in this process.

        Returns:
          The replies, in the order of the messages.
        """
        return [r for r in (self._answer(msg) for msg in messages) if r is not None]

    def _answer(self, msg: Message) -> Message | None:
        """The node's reply to ``msg``: its ClientApp's, an error reply if it raised, None if dead."""
        dst = msg.metadata.dst_node_id
        if dst in self.dead or dst not in self.contexts:
            return None  # no reply: a missing answer at the strategy
        msg.metadata.created_at = time.time()
        try:
            return self.client_app(msg, self.contexts[dst])
        except Exception as e:  # noqa: BLE001 - a failing ClientApp is an error reply, as on a SuperNode
            return Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=msg)
