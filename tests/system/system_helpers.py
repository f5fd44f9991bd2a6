"""Helpers of the system tests.

A small config of the whole system (6 digits nodes, every strategy, one ALIE attacker), file
snapshots, ``--set`` flags, and a Flower deployment on loopback (a SuperLink, k SuperNodes and
``flwr run``) for the deployment tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from flower_helpers import APP_PYPROJECT, free_port

from meta_consensus import config

SMALL = [
    "rounds=3",
    "seed=3",
    "checkpoint_every=1",
    "keep_checkpoints=5",
    "task.options.hidden=[16]",
    "nodes.count=6",
    "nodes.strategies=['hierarchical', 'convexity', 'soup', 'local', 'local', 'local']",
    "nodes.local_steps=12",
    "nodes.learning_rate=0.01",
    "nodes.options.soup.snapshots=2",
    "byzantine.nodes=[5]",
    "byzantine.attack=alie",
    "byzantine.options={z = 3.0}",
    "vote.rule=multi_krum",
    "vote.num_byzantine=1",
    "weights.objective=mixture_nll",
    "weights.max_weight=0.5",
    "dp.enabled=true",
    "dp.clip_norm=1.0",
    "dp.noise_multiplier=0.5",
]


def small_config(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*SMALL, f"output_dir={tmp_path}", "name=small", *overrides])


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes (directories as entries too)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def sets(*items: str) -> list[str]:
    """``--set`` flags for each override."""
    return [a for s in items for a in ("--set", s)]


BIN = Path(sys.executable).parent  # the venv's flower-superlink, flower-supernode and flwr


def flower_app(folder: Path) -> Path:
    """Write a Flower app (FAB) naming the package's ServerApp and ClientApp into ``folder``.

    Args:
      folder: the app's folder (created).

    Returns:
      ``folder``.
    """
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


def partitions(count: int) -> list[str]:
    """``--node-config`` of ``count`` SuperNodes: ``partition-id=i num-partitions=count``.

    Args:
      count: the number of SuperNodes.

    Returns:
      One node config per SuperNode.
    """
    return [f"partition-id={i} num-partitions={count}" for i in range(count)]


@dataclasses.dataclass
class Deployment:
    """A running loopback deployment (see :func:`loopback_deployment`).

    Args:
      folder: where the logs (``superlink.log``, ``supernode{i}.log``, ``flwr_run.log``) go.
      app: the Flower app's folder.
      env: the environment of every process (FLWR_HOME names the SuperLink as "local").
      nodes: the SuperNodes' processes, in node-config order (each leads a process group).
      procs: every process started, killed when the deployment ends.
    """

    folder: Path
    app: Path
    env: dict[str, str]
    nodes: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def start(self, args: list[str], log: str) -> subprocess.Popen:
        """Start ``args`` in a session of its own, stdout and stderr to ``folder / log``.

        Args:
          args: the command line.
          log: the log file's name.

        Returns:
          The process.
        """
        fh = open(self.folder / log, "w")  # noqa: SIM115 - closed when the deployment ends
        p = subprocess.Popen(args, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        p.log = fh  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        """The text of the log ``name`` ("" while it does not exist)."""
        path = self.folder / name
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def loopback_deployment(
    folder: Path, app: Path, node_configs: Sequence[str], *, pythonpath: Sequence[Path] = ()
) -> Iterator[Deployment]:
    """A SuperLink and one SuperNode per node config on free 127.0.0.1 ports (insecure: tests only).

    flwr's own config (FLWR_HOME, a folder under ``folder``) names this SuperLink "local". On
    exit every process started through the deployment (``flwr run`` too) is killed with its
    process group and its log closed.

    Args:
      folder: the test's folder (logs, FLWR_HOME).
      app: the Flower app's folder (:func:`flower_app`).
      node_configs: each SuperNode's ``--node-config``, e.g. :func:`partitions`.
      pythonpath: folders put first on the processes' PYTHONPATH (a task module of the tests).

    Yields:
      The :class:`Deployment`.
    """
    home = folder / "flwr_home"
    home.mkdir()
    link = free_port()
    connection = f'address = "127.0.0.1:{link}"\ninsecure = true\n'
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n{connection}')
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]),
        JAX_PLATFORMS="cpu",
    )
    dep = Deployment(folder, app, env)
    try:
        superlink = [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link)]
        dep.start(superlink, "superlink.log")
        for i, node_config in enumerate(node_configs):
            supernode = [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link}"]
            supernode += ["--host", "127.0.0.1", "--port", str(free_port()), "--node-config", node_config]
            dep.nodes.append(dep.start(supernode, f"supernode{i}.log"))
        yield dep
    finally:
        for p in dep.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            p.log.close()  # type: ignore[attr-defined]


def flwr_run(
    dep: Deployment, run_config: str, *, timeout_s: float, poll: Callable[[], None] | None = None
) -> None:
    """``flwr run`` of the deployment's app on its SuperLink, waited for; asserts it exits 0.

    Args:
      dep: the running deployment.
      run_config: ``--run-config`` (the app's config keys).
      timeout_s: how long to wait for it.
      poll: called every half second while it runs (e.g. to kill a SuperNode at some point).
    """
    args = [str(BIN / "flwr"), "run", str(dep.app), "local", "--stream", "--run-config", run_config]
    run = dep.start(args, "flwr_run.log")
    deadline = time.monotonic() + timeout_s
    while run.poll() is None and time.monotonic() < deadline:
        if poll is not None:
            poll()
        time.sleep(0.5)
    assert run.poll() is not None, "flwr run did not finish in time: " + dep.log("flwr_run.log")[-3000:]
    assert run.returncode == 0, dep.log("flwr_run.log")[-3000:]
