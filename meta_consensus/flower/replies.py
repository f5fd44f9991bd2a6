"""A round's replies without waiting for the dead: :class:`RoundGrid` (a workaround for flwr 1.42).

Flower's ``Grid.send_and_receive`` pushes the messages, then pulls the replies of all the
pending messages in one ``pull_messages`` call every 3 s until each has a reply or the
timeout runs out. On a deployment (flwr 1.42.0, ``flwr/superlink/grid/http_grid.py:384``)
``HttpGrid.pull_messages`` (``http_grid.py:304``) downloads every reply the SuperLink hands
out with ``pull_objects`` (``flwr/supercore/inflatable/inflatable_utils.py:201``: up to
``PULL_MAX_TIME`` = 7200 s, 500 tries, back-off capped at 10 s). A SuperNode that dies while
it uploads its reply has already pushed the reply message (``Fleet.PushMessages`` stores it
and pre-registers its objects in an *object-push session*,
``flwr/superlink/servicer/fleet/fleet_handlers.py:247``) but not all its arrays; the
SuperLink hands that reply out at once and the pull blocks on the missing objects until
the push session expires, ``OBJECT_PUSH_SESSION_TTL_SECONDS`` = 180 s after the node's last
object (``flwr/supercore/constant.py:45``, ``flwr/supercore/corestate/in_memory_corestate.py``
``get_object``), and only then returns an error reply ("Reply message objects are
unavailable ..."). Every other reply waits behind it: the SuperLink's own error reply for a
node whose heartbeat stopped ("Node Unavailable", after ``HEARTBEAT_PATIENCE`` = 2 heartbeat
intervals of 30 s, ``flwr/server/superlink/linkstate/utils.py:281``) never helps here, since
the reply is already "found". With a round timeout of 180 s or less the round ends with only
the replies pulled before the stuck one, although the others were sent.

:class:`RoundGrid` wraps any Grid and replaces ``send_and_receive`` with: ``push_messages``,
one puller thread per message (``pull_messages([id])`` every ``poll_s``), so a pull stuck on
one node's reply holds only that node's answer; and a check of ``get_node_ids()`` every
``poll_s`` (the SuperLink lists ONLINE nodes only): a node with no reply that the SuperLink
no longer lists is given up at once, with the error reply ``"no reply: node went offline"``.
The round ends when every message has a reply or an error (Flower's, or one of these), or at
the timeout, where each message still pending gets the error reply ``"no reply before the
round's timeout"``. Every sent message thus has exactly one reply, and the strategy files
each under its partition. A stuck puller is a daemon thread whose late result is dropped.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from flwr.app import Error, Message
from flwr.serverapp import Grid

FLOWER_VERSION = "1.42.0"  # the flwr whose pull_messages this works around (see the module docstring)
NODE_GONE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE
NO_REPLY = 0  # flwr.common.constant.ErrorCode.UNKNOWN
OFFLINE_REASON = "no reply: node went offline (the SuperLink no longer lists it)"
TIMEOUT_REASON = "no reply before the round's timeout"
NOT_PUSHED_REASON = "not sent: the SuperLink refused the message (Flower's log says why)"


def no_reply(msg: Message, code: int, reason: str) -> Message:
    """The error reply that stands for ``msg``'s missing reply (its source is ``msg``'s destination).

    Args:
      msg: the message that got no reply.
      code: Flower's error code.
      reason: why there is no reply.

    Returns:
      The error reply.
    """
    return Message(Error(code=code, reason=reason), reply_to=msg)


class RoundGrid(Grid):
    """``grid`` whose ``send_and_receive`` does not wait for nodes that are gone (see the module docstring).

    Args:
      grid: the Grid Flower gives the ServerApp (or any Grid with push/pull/get_node_ids).
      poll_s: seconds between two pulls of one message's reply, and between two node-list checks.
      dst_of: filled with message id -> destination node id of every message pushed.
    """

    def __init__(self, grid: Grid, *, poll_s: float = 1.0, dst_of: dict[str, int] | None = None):
        self.grid = grid
        self.poll_s = float(poll_s)
        self.dst_of: dict[str, int] = {} if dst_of is None else dst_of

    # ------------------------------------------------------------------ the Grid, delegated

    def set_run(self, run: Any) -> None:
        """Flower's ``set_run``, on the wrapped grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(  # noqa: PLR0913 - Flower's signature
        self, content: Any, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        """Flower's ``create_message``, on the wrapped grid."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's node ids (the nodes the SuperLink lists as online)."""
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Flower's ``push_messages``, on the wrapped grid."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Flower's ``pull_messages``, on the wrapped grid."""
        return self.grid.pull_messages(message_ids)

    # ------------------------------------------------------------------ the round

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Push ``messages`` and gather one reply for each, giving up on nodes that are gone.

        Args:
          messages: the round's messages.
          timeout: seconds to wait for the replies (None: until each has one).

        Returns:
          Exactly one reply per message: the node's, Flower's error reply, or an error reply of
          this grid (not sent, node went offline, no reply before the timeout, pull failed).
        """
        messages = list(messages)
        if not messages:
            return []
        deadline = time.monotonic() + (math.inf if timeout is None else float(timeout))
        ids = list(self.grid.push_messages(messages))
        if len(ids) != len(messages):  # HttpGrid returns [] for a payload too large (and logs it)
            ids = [""] * len(messages)
        replies: list[Message] = []
        pending: dict[str, Message] = {}
        for msg, mid in zip(messages, ids, strict=True):
            if mid:
                pending[mid] = msg
                self.dst_of[mid] = msg.metadata.dst_node_id
            else:
                replies.append(no_reply(msg, NO_REPLY, NOT_PUSHED_REASON))
        got: queue.Queue[tuple[str, list[Message] | BaseException]] = queue.Queue()
        stop = threading.Event()

        def pull(mid: str) -> None:
            """Pull ``mid``'s reply every ``poll_s`` until it comes (or fails), then queue it."""
            while not stop.is_set():
                try:
                    res = list(self.grid.pull_messages([mid]))
                except BaseException as e:  # noqa: BLE001 - handed to the round, which files it
                    got.put((mid, e))
                    return
                if res:
                    got.put((mid, res))
                    return
                stop.wait(self.poll_s)

        for mid in pending:
            threading.Thread(target=pull, args=(mid,), name=f"pull {mid[:8]}", daemon=True).start()
        try:
            next_check = time.monotonic() + self.poll_s
            while pending:
                now = time.monotonic()
                if now >= deadline:
                    replies.extend(no_reply(m, NO_REPLY, TIMEOUT_REASON) for m in pending.values())
                    break
                try:
                    mid, res = got.get(timeout=max(0.0, min(next_check, deadline) - now))
                except queue.Empty:
                    pass
                else:
                    sent = pending.pop(mid, None)
                    if sent is not None:
                        if isinstance(res, BaseException):
                            reason = f"pulling the reply failed: {type(res).__name__}: {res}"
                            replies.append(no_reply(sent, NO_REPLY, reason))
                        else:
                            replies.extend(res)
                    if not got.empty():
                        continue  # take every reply that is here before asking who is gone
                if pending and time.monotonic() >= next_check:
                    online = set(self.grid.get_node_ids())
                    for mid in [m for m, msg in pending.items() if msg.metadata.dst_node_id not in online]:
                        replies.append(no_reply(pending.pop(mid), NODE_GONE, OFFLINE_REASON))
                    next_check = time.monotonic() + self.poll_s
        finally:
            stop.set()
        return replies
