"""Two local processes under ``jax.distributed`` (CPU collectives over gloo) train the stacked nodes.

Each process hosts 4 of 8 simulated CPU devices and 4 of 8 digits nodes, loads only
its nodes' data, and trains on the global ("node",) mesh. The test checks that the
processes' data shards are disjoint and together make the single-process run's data,
that only process 0 logged and wrote, and that the stacked params equal a single-process
run of the same config on 8 devices. Every wait is bounded, so a hung collective fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")
TIMEOUT_S = 240  # generous for a loaded 2-core CI box; a healthy run takes well under a minute
STEPS = 20


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(out: str, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = [sys.executable, WORKER, "--out", out, "--steps", str(STEPS), "--timeout", "60", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_all(procs: dict[str, subprocess.Popen]) -> dict[str, str]:
    """Wait for every process (bounded); on timeout or failure kill the rest and fail with their output."""
    outputs: dict[str, str] = {}
    deadline = time.monotonic() + TIMEOUT_S  # one bound for all of them, not one each
    try:
        for name, p in procs.items():
            try:
                outputs[name], _ = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                p.kill()
                outputs[name] = p.communicate()[0]
                pytest.fail(
                    f"{name} did not finish in {TIMEOUT_S}s (hung collective?):\n{outputs[name][-3000:]}"
                )
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, p in procs.items():
        if p.returncode != 0:
            pytest.fail(f"{name} exited with {p.returncode}:\n{outputs[name][-3000:]}")
    return outputs


def _logged(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("[process ")]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_disjoint_shards_to_the_single_process_params(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    multi.mkdir()
    single.mkdir()
    port = _free_port()
    common = ["--num-processes", "2", "--port", str(port), "--local-devices", "4"]
    # The reference runs concurrently with the two workers: one process, 8 devices, same config.
    procs = {
        "process 0": _launch(str(multi), "--process-id", "0", *common),
        "process 1": _launch(str(multi), "--process-id", "1", *common),
        "reference": _launch(str(single), "--num-processes", "1", "--local-devices", "8"),
    }
    out = _wait_all(procs)

    # Only process 0 logs and writes the log and params; every process writes its own shard record.
    assert sorted(os.listdir(multi)) == ["log.txt", "params.npz", "shard_0.npz", "shard_1.npz"]
    assert _logged(out["process 1"]) == []
    lines = _logged(out["process 0"])
    assert lines and all(line.startswith("[process 0/2]") for line in lines)
    log_file = (multi / "log.txt").read_text().splitlines()
    assert log_file == lines
    assert "8 global, 4 local" in log_file[0]

    # Data: each process loaded its own contiguous block of nodes; the shards are disjoint and
    # together are exactly the single-process run's data.
    s0, s1 = np.load(multi / "shard_0.npz"), np.load(multi / "shard_1.npz")
    ref = np.load(single / "shard_0.npz")
    np.testing.assert_array_equal(s0["node_ids"], np.arange(4))
    np.testing.assert_array_equal(s1["node_ids"], np.arange(4, 8))
    ids0, ids1 = s0["example_ids"], s1["example_ids"]
    real0, real1 = set(ids0[ids0 >= 0].tolist()), set(ids1[ids1 >= 0].tolist())
    assert real0 and real1 and not real0 & real1
    assert len(real0) == int(s0["train_count"].sum()) and len(real1) == int(s1["train_count"].sum())
    ref_ids = ref["example_ids"]
    np.testing.assert_array_equal(ref_ids[:4, : ids0.shape[1]], ids0)
    np.testing.assert_array_equal(ref_ids[4:, : ids1.shape[1]], ids1)

    # Params: gathered from both processes, equal to the single-process run.
    got, want = np.load(multi / "params.npz"), np.load(single / "params.npz")
    assert sorted(got.files) == sorted(want.files) and got.files
    init_like = []
    for k in want.files:
        assert got[k].shape == want[k].shape and got[k].shape[0] == 8, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
        init_like.append(np.abs(want[k][0] - want[k][1]).max())
    assert max(init_like) > 1e-3  # nodes trained on different data really ended up different
