"""A ClientApp for the deployment tests: the package's, after a pause its SuperNode's node config sets.

``--node-config "partition-id=2 num-partitions=3 delay-s=600"`` makes that SuperNode's node
sleep 600 s before each training (evaluation and queries answer at once): a deliberately slow
node on a real deployment, without touching the package's ClientApp.
"""

from __future__ import annotations

import time

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from meta_consensus.flower.node import evaluate_reply, query_reply, train_reply

client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    time.sleep(float(context.node_config.get("delay-s", 0.0)))  # type: ignore[arg-type]
    return train_reply(msg, context)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return evaluate_reply(msg, context)


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    return query_reply(msg, context)
