"""Example-level DP (dp.level = "example"): node epsilons, calibration, budget, leaks, privacy.json, resume.

The node epsilons are checked against an independent numerical reference of the
Poisson-subsampled Gaussian written here with scipy (quadrature of the Renyi moments and of
the hockey-stick divergence), not against the package's accountant code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from scipy import integrate, optimize, stats
from system_helpers import SMALL

from consensus.privacy import DEFAULT_ORDERS
from meta_consensus import Coordinator, MetaConsensus, config
from meta_consensus.config import ConfigError
from meta_consensus.example_level_dp import ExampleAccountant, check_no_leaks
from strategies.dpsgd import effective_rate, sampling_rates

# No hierarchical node (its "groups" level reads the node's private classes: refused, tested below);
# the soup scores its snapshots on the coordinator's held-out split, not on rows of its own shard.
EXAMPLE = [
    *SMALL,
    "nodes.strategies=['convexity', 'soup', 'local', 'local', 'local', 'local']",
    "nodes.options.soup.heldout=shared",
    "dp.level=example",
]


def _cfg(tmp_path, *extra):
    return config.load(None, [*EXAMPLE, f"output_dir={tmp_path}", "name=ex", *extra])


# ----------------------------------------------------------------------------- references


def _log_moment(q: float, z: float, alpha: float) -> float:
    """log E_{x ~ N(0, z^2)} [((1 - q) + q exp((2x - 1) / (2 z^2)))^alpha] by quadrature."""

    def log_integrand(x):
        mix = np.logaddexp(np.log1p(-q), np.log(q) + (2 * x - 1) / (2 * z * z))
        return stats.norm.logpdf(x, scale=z) + alpha * mix

    # Scale by the integrand's peak so the quadrature sees numbers near 1.
    grid = np.linspace(-12 * z, 12 * z + alpha, 4001)
    peak = float(np.max(log_integrand(grid)))
    value, _ = integrate.quad(
        lambda x: math.exp(log_integrand(x) - peak),
        -14 * z,
        14 * z + alpha,
        limit=400,
        epsabs=0,
        epsrel=1e-11,
    )
    return math.log(value) + peak


def _rdp_reference(q: float, z: float, steps: int, delta: float) -> float:
    best = math.inf
    for a in (o for o in DEFAULT_ORDERS if o <= 64):
        rdp = steps * _log_moment(q, z, a) / (a - 1)
        best = min(best, rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return best


def _hockey_stick(q: float, z: float, eps: float) -> float:
    """max over both orders of the one-step hockey-stick divergence, by quadrature of the densities."""
    p = lambda x: (1 - q) * stats.norm.pdf(x, scale=z) + q * stats.norm.pdf(x, loc=1, scale=z)  # noqa: E731
    r = lambda x: stats.norm.pdf(x, scale=z)  # noqa: E731
    # p / r = (1 - q) + q exp((2x - 1) / (2 z^2)) is increasing: each integral has one end at a crossing.
    out = 0.0
    if math.exp(eps) > 1 - q:
        x1 = z * z * math.log((math.exp(eps) - (1 - q)) / q) + 0.5
        out = max(out, integrate.quad(lambda x: p(x) - math.exp(eps) * r(x), x1, np.inf, epsabs=1e-14)[0])
    if math.exp(-eps) > 1 - q:
        x2 = z * z * math.log((math.exp(-eps) - (1 - q)) / q) + 0.5
        out = max(out, integrate.quad(lambda x: r(x) - math.exp(eps) * p(x), -np.inf, x2, epsabs=1e-14)[0])
    return out


def _one_step_epsilon(q: float, z: float, delta: float) -> float:
    return optimize.brentq(lambda e: _hockey_stick(q, z, e) - delta, 1e-6, 50.0, xtol=1e-10)


# ----------------------------------------------------------------------------- accounting


@pytest.mark.slow
def test_node_epsilons_match_a_numerical_reference_of_the_subsampled_gaussian(tmp_path):
    cfg = _cfg(tmp_path, "dp.noise_multiplier=1.1", "nodes.batch_size=32")
    counts = [290, 517]
    acc = ExampleAccountant(cfg, counts, [40, 40], fleets=1)
    q = effective_rate(sampling_rates(counts, 32))
    np.testing.assert_array_equal(acc.rate, q)
    nodes = acc.nodes([300, 1])
    # RDP over 300 steps: quadrature of the Renyi moments.
    ref = _rdp_reference(q[0], 1.1, 300, acc.delta_acc)
    assert nodes[0].epsilon_rdp == pytest.approx(ref, rel=1e-6)
    # PLD after one step: the hockey-stick divergence itself (PLD is pessimistic: never below it).
    exact = _one_step_epsilon(q[1], 1.1, acc.delta_acc)
    assert exact <= nodes[1].epsilon_pld <= exact + 0.02
    assert nodes[0].epsilon_pld <= nodes[0].epsilon_rdp
    assert nodes[0].steps == 300 and nodes[0].noise_multiplier == 1.1


def test_calibration_meets_each_nodes_target_and_the_budget_stops_before_it(tmp_path):
    cfg = _cfg(tmp_path, "dp.noise_multiplier=none", "dp.epsilon=3.0", "rounds=5")
    counts, per_round = [200, 400, 800], [12, 12, 12]
    acc = ExampleAccountant(cfg, counts, per_round, fleets=2)
    planned = 5 * 12 * 2
    for node in acc.nodes([planned] * 3, pld=False):
        assert 3.0 * (1 - 5e-3) <= node.epsilon_rdp <= 3.0
    assert len(set(np.round(acc.z, 6))) == 3  # every node its own z from its own q
    assert acc.over_budget([planned - 24] * 3) == ""
    assert "over the budget 3" in acc.over_budget([planned] * 3)


def test_overflow_share_of_delta_covers_the_pad(tmp_path):
    cfg = _cfg(tmp_path, "dp.noise_multiplier=1.0")
    counts = [150, 300]
    acc = ExampleAccountant(cfg, counts, [12, 12], fleets=2)
    for n, q, t, node in zip(counts, acc.rate, acc.planned, acc.nodes(acc.planned, pld=False), strict=True):
        tail = stats.binom.sf(acc.pad, n + 1, q)
        assert (1 + math.exp(node.epsilon_rdp)) * t * tail <= acc.delta - acc.delta_acc


# ----------------------------------------------------------------------------- leaks


def test_configs_that_leak_are_refused_with_the_part_that_leaks(tmp_path):
    shared = "nodes.options.soup.heldout=shared"
    base = [*SMALL, "dp.level=example", f"output_dir={tmp_path}"]  # a hierarchical and a soup node
    # The hierarchical node's "groups" level picks public rows by its private class histogram.
    with pytest.raises(ConfigError, match=r"\['hierarchical'\].*'groups' level"):
        Coordinator(config.load(None, [*base, shared]))
    # The soup node would score snapshots on private rows of its own shard.
    no_groups = "nodes.options.hierarchical.fractions=[0.75, 0.0, 0.25]"
    with pytest.raises(ConfigError, match=r"\['soup'\].*own shard.*heldout = 'shared'"):
        Coordinator(config.load(None, [*base, no_groups]))
    # The union pool is node data.
    with pytest.raises(ConfigError, match=r"\['hierarchical'\].*general pool.*holds node data"):
        Coordinator(config.load(None, [*base, shared, no_groups, "task.general_pool=union"]))
    # Public pool, no groups level, soups on the shared split: accepted.
    cfg = config.load(None, [*base, shared, no_groups])
    Coordinator(cfg)
    settings = [s.settings(12, 0.01) for s in cfg.nodes.build_strategies()]
    assert settings[0].level_steps[0] > 0

    class PublicPool:
        name = "public"
        public_general = True

    check_no_leaks(cfg, PublicPool(), settings)  # a task of its own that declares its pool public

    class NodeDataPool:
        name = "private"

    with pytest.raises(ConfigError, match="general pool"):
        check_no_leaks(cfg, NodeDataPool(), settings)
    # Hierarchical nodes with no step on the general pool do not touch it.
    own_only = [dataclasses.replace(st, level_steps=(0, 0, 12)) for st in settings]
    check_no_leaks(cfg, NodeDataPool(), own_only)
    with pytest.raises(ConfigError, match="adaptive clipping is node-level only"):
        config.load(None, [*EXAMPLE, "dp.adaptive=true"])


# ----------------------------------------------------------------------------- a run


@pytest.mark.slow  # two short runs (~90 s on two shared cores)
def test_run_writes_privacy_json_with_the_numbers_of_the_table_and_metrics(tmp_path):
    cfg = _cfg(tmp_path, "rounds=2", "dp.noise_multiplier=none", "dp.epsilon=6.0")
    result = MetaConsensus(cfg, progress=False).train()
    assert result.succeeded == 2 and not result.stopped
    priv = json.loads((tmp_path / "ex" / "privacy.json").read_text())
    assert priv["level"] == "example" and priv["delta"] == 1e-5
    assert [p["node"] for p in priv["nodes"]] == list(range(6))
    for p in priv["nodes"]:
        assert set(p) == {"node", "sampling_rate", "noise_multiplier", "steps", "epsilon_rdp", "epsilon_pld"}
        assert p["steps"] == 2 * 12 * 2  # both fleets (the FedAvg baseline trains on the same examples)
        assert p["epsilon_pld"] <= p["epsilon_rdp"] <= 6.0
    assert priv["epsilon"] == max(p["epsilon_rdp"] for p in priv["nodes"])
    last = json.loads((tmp_path / "ex" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["epsilon"] == priv["epsilon"]
    assert last["node_epsilon"] == [p["epsilon_rdp"] for p in priv["nodes"]]
    assert last["train_loss"] == ["nan"] * 6  # private training losses stay on the nodes
    table = (tmp_path / "ex" / "table.txt").read_text()
    assert f"epsilon = {priv['epsilon']:.4g} (max over nodes)" in table
    assert "node epsilons: 0: " in table
    # A budget below what the next round costs stops the run before it.
    low = _cfg(tmp_path, "name=low", "rounds=3", "dp.noise_multiplier=1.0", "dp.budget=1.0")
    stopped = MetaConsensus(low, write=False, progress=False).train()
    assert "privacy budget" in stopped.stopped and "over the budget 1" in stopped.stopped


@pytest.mark.slow  # one short run
def test_hierarchical_nodes_train_on_the_public_pool_under_dp_sgd(tmp_path):
    cfg = _cfg(
        tmp_path,
        "rounds=1",
        "baseline_fedavg=false",
        "nodes.strategies=['hierarchical', 'soup', 'local', 'local', 'hierarchical', 'local']",
        "nodes.options.hierarchical.fractions=[0.75, 0.0, 0.25]",
        "dp.noise_multiplier=1.0",
    )
    mc = MetaConsensus(cfg, write=False, progress=False)
    result = mc.train()
    assert result.succeeded == 1
    info = result.history[-1]
    # Every step is charged, the public ones too: the hierarchical nodes' epsilon is that of 12
    # DP-SGD steps at their own shard's rate, like the local nodes' at theirs.
    acc = mc.coordinator.example
    for node in acc.nodes([12] * 6, pld=False):
        assert info.node_epsilon[node.node] == pytest.approx(node.epsilon_rdp)
    assert np.isfinite(info.epsilon) and np.all(np.isfinite(info.node_epsilon))


# ----------------------------------------------------------------------------- resume


def _cmd(out, name, *extra):
    sets = [*EXAMPLE, "rounds=4", "checkpoint_every=2", f"output_dir={out}", f"name={name}"]
    args = [sys.executable, "-m", "meta_consensus", "run", "--quiet", *extra]
    for s in sets:
        args += ["--set", s]
    return args


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.getcwd()
    return env


def _saved(state):
    return (state.consensus, state.nodes.params, state.nodes.opt_state, state.nodes.step)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_then_resume_with_dp_sgd_is_bit_exact(tmp_path):
    full = subprocess.run(_cmd(tmp_path, "full"), env=_env(), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-2000:]
    killed = subprocess.Popen(
        _cmd(tmp_path, "cut"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            assert killed.poll() is None, killed.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            killed.kill()
        killed.communicate()
    resumed = subprocess.run(
        _cmd(tmp_path, "cut", "--resume"), env=_env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    states = []
    for name in ("full", "cut"):
        cfg = config.load(tmp_path / name / "config.toml")
        from meta_consensus.checkpoint import RunCheckpoints

        ckpt = RunCheckpoints(tmp_path / name, cfg)
        state, _ = ckpt.restore(Coordinator(cfg).init(cfg.seed))
        ckpt.close()
        states.append(state)
    a, b = states
    for x, y in zip(jax.tree.leaves(_saved(a)), jax.tree.leaves(_saved(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (tmp_path / "full" / "privacy.json").read_text() == (tmp_path / "cut" / "privacy.json").read_text()
    rows = [
        [
            {k: v for k, v in json.loads(line).items() if k not in ("seconds", "solve_ms")}
            for line in f.splitlines()
        ]
        for f in ((tmp_path / n / "metrics.jsonl").read_text() for n in ("full", "cut"))
    ]
    assert rows[0] == rows[1]
