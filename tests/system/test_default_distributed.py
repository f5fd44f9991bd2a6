"""The default config (with soup nodes holding out rows of their own shard) on two processes logs
what one does.

Two ``jax.distributed`` processes (loopback, gloo), each with one CPU device and half of the
nodes, against one process with the same ("node" = 2) mesh on two devices; all three run
``meta-consensus run`` with the embedded default config, shortened. The soup nodes' own
held-out rows live on the process that hosts them, and every process scores every soup node,
so the rows are shared at start-up; metrics.jsonl must then be the same line for line, but
for wall-clock timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils
from test_system_distributed import _env, _free_port, _wait

from meta_consensus import config, fleet
from strategies.tasks.digits import DigitsTask

# The default with the former strategy mix, so that soup nodes (own held-out rows) and the public
# warm start both run on two processes.
MIX = (
    "nodes.strategies=['hierarchical', 'hierarchical', 'convexity', 'convexity', 'soup', 'soup', 'local', "
    "'local']"
)
SETS = ["rounds=2", "nodes.local_steps=4", "mesh.node=2", "eval_every=1", MIX, "nodes.public_warm_start=20"]


def _run(out, name, *extra):
    args = [sys.executable, "-m", "meta_consensus", "run", "--quiet", *extra]
    for s in [*SETS, f"output_dir={out}", f"name={name}"]:
        args += ["--set", s]
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _untimed(value):
    """The value with every wall-clock entry (keys naming seconds or milliseconds) left out."""
    if isinstance(value, dict):
        return {
            k: _untimed(v)
            for k, v in value.items()
            if not (k == "seconds" or k.endswith(("_ms", "_s", "_seconds")) or "time" in k)
        }
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [_untimed(json.loads(line)) for line in lines]


# Like the other two-process tests: starts three processes (each imports jax and compiles the round).
@pytest.mark.slow
@pytest.mark.multiprocess
def test_default_config_on_two_processes_logs_what_one_logs(tmp_path):
    port = _free_port()
    dist = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--local-devices", "1"]
    procs = {f"process {i}": _run(tmp_path, "multi", *dist, "--process-id", str(i)) for i in range(2)}
    procs["one process"] = _run(tmp_path, "single", "--local-devices", "2")
    _wait(procs)
    multi, single = _metrics(tmp_path / "multi"), _metrics(tmp_path / "single")
    # The case this covers: the default's soup nodes score on rows of their own shard.
    cfg = config.load(tmp_path / "multi" / "config.toml")
    assert any(s.settings(4, 0.01).own_heldout > 0 for s in cfg.nodes.build_strategies())
    assert len(single) == 2 and all(line["ok"] for line in single)
    assert multi == single


def test_every_process_gets_the_rows_one_process_holds_out(monkeypatch):
    """Each process draws its own nodes' held-out rows; after the gather every process has, for
    every node, the rows one process draws. Two processes simulated by two threads whose
    ``process_allgather`` stacks both threads' inputs, as jax.distributed does."""
    n, seed = 6, 4
    # Nodes 1, 3 and 4 keep rows, with different counts: both processes host some.
    fractions = np.array([0.0, 0.3, 0.0, 0.2, 0.5, 0.0])
    task = DigitsTask(hidden=(8,))

    def hosted(index, count):
        data = task.splits(n, seed=seed, process_index=index, process_count=count)
        return data.hold_out_own(fractions[data.node_ids], seed)

    one = fleet._own_heldout_batches(hosted(0, 1), 1)
    assert sorted(one) == [1, 3, 4]
    datas = [hosted(i, 2) for i in range(2)]
    assert [d.node_ids.tolist() for d in datas] == [[0, 1, 2], [3, 4, 5]]
    slots: list = [None, None]
    barrier = threading.Barrier(2)
    local = threading.local()

    def allgather(x):
        slots[local.index] = x
        barrier.wait()
        out = jax.tree.map(lambda a, b: np.stack([a, b]), *slots)
        barrier.wait()  # both read the slots before the next call writes them
        return out

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    results: list = [None, None]

    def process(i):
        local.index = i
        results[i] = fleet._own_heldout_batches(datas[i], 2)

    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for two in results:
        assert two is not None and sorted(two) == sorted(one)
        for node, batch in one.items():
            assert sorted(two[node]) == sorted(batch)
            for k, v in batch.items():
                assert two[node][k].dtype == v.dtype
                np.testing.assert_array_equal(two[node][k], v)
