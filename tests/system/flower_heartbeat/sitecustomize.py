"""Loaded at start-up by the Flower processes of ``test_flower_deployment.py`` (on their PYTHONPATH only).

Flower's SuperNodes announce a 30 s heartbeat interval and the SuperLink declares a node
unavailable after 2 intervals, so a killed node costs a round 60 s of waiting. The test sets
the interval to Flower's own minimum, 10 s (the SuperLink refuses less), before any Flower
module reads it: the deployment is otherwise unchanged, and the lost node is declared after
20 s. Nothing else imports this file.
"""

import flwr.common.constant as _constant

_constant.HEARTBEAT_DEFAULT_INTERVAL = _constant.HEARTBEAT_MIN_INTERVAL
