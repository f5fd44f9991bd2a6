"""The ``meta-consensus`` command (also ``python -m meta_consensus``).

::

    meta-consensus run [--config FILE | --preset NAME] [--set key=value ...] [--plugin MODULE ...]
                       [--resume | --overwrite] [--quiet] [--init FILE]
    meta-consensus report runs/<name>
    meta-consensus export runs/<name> [--out DIR]
    meta-consensus models fetch smollm2
    meta-consensus merge --method NAME [--set method.PARAM=VALUE ...] [--plugin MODULE ...] [--base BASE]
                         --out DIR INPUT...

``run`` with no arguments runs the embedded default (digits, 8 nodes with mixed
strategies, 2 ALIE attackers, Multi-Krum vote, mixture-NLL convex weights, DP).
A multi-process run starts the same command once per process with
``--coordinator HOST:PORT --num-processes P --process-id I``
(``jax.distributed``); each process hosts a block of the nodes.

``--plugin MODULE`` imports a user's module (the current directory is importable)
whose declared rules, attacks, node strategies, weight objectives, tasks or merge
methods are then valid names; ``run`` records it in the config (``plugins``), so the
run directory's ``config.toml`` loads it again. A plug-in that fails to import is a
user error.

Exit codes: 0 done; 1 no round succeeded, or a process of a multi-process run was
lost; 2 a user error (bad arguments or config, a run directory that holds another
run, checkpoints of another config or none intact, a task whose model, data or
factory fails its checks before training), always one line on stderr (``--debug``
adds the traceback) and no file changed; 130 interrupted (Ctrl-C); 143 stopped by SIGTERM after
saving a checkpoint (continue with ``--resume``). See docs/operations.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meta_consensus import models_cli
from meta_consensus._version import __version__

EXIT_NO_ROUND = 1
EXIT_PROCESS_LOST = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_SIGTERM = 143


class UserError(Exception):
    """A mistake of the user's (arguments, config, files): one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``meta-consensus run: error: ...``."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fail(message: str) -> int:
    print(f"meta-consensus: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_USAGE


def _add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable), shared by the subcommands that read declared names."""
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module first (current directory importable): its declared rules, attacks, "
        "node strategies, weight objectives, tasks and merge methods become valid names",
    )


def _add_debug_option(parser: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """``--debug``: a user error prints its traceback before its one line (still exit 2)."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="on an error of the config, the task, the model or the data, show the traceback too",
    )


def _load_plugins(modules: list[str]) -> None:
    """The installed plug-ins and ``modules``; a failure is one line naming the module (exit 2)."""
    from consensus.plugins import PluginError, load_entry_points, load_plugins

    try:
        load_entry_points()
        load_plugins(modules)
    except PluginError as e:
        raise UserError(str(e)) from e


def _preset_names() -> list[str]:
    """The presets shipped with the package (as ``config.preset_names``, without importing jax)."""
    import importlib.resources

    folder = importlib.resources.files("meta_consensus").joinpath("presets")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="meta-consensus", description="Model merging by consensus on JAX.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_debug_option(ap, default=False)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the rounds of a config (default: the embedded demo)")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--config", help="TOML config file (default: the embedded default)")
    source.add_argument(
        "--preset",
        choices=_preset_names(),
        help="a config shipped with the package: robust (16 nodes, DnC, quadratic weights), "
        "private (example-level DP-SGD), lora (adapters of a frozen base)",
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rounds=5 --set vote.rule=median",
    )
    _add_plugin_option(run)
    again = run.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue from the run's newest intact checkpoint"
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="if runs/<name> holds an earlier run, move it aside to runs/<name>.old-<k> (never deleted)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--init",
        metavar="FILE",
        help="start from this safetensors checkpoint (sets init_from; checked against the task)",
    )
    run.add_argument("--coordinator", help="jax.distributed coordinator address HOST:PORT (multi-process)")
    run.add_argument("--num-processes", type=int, default=1)
    run.add_argument("--process-id", type=int, default=0)
    run.add_argument(
        "--local-devices",
        type=int,
        default=None,
        help="CPU devices per process (sets XLA_FLAGS before jax starts)",
    )
    rep = sub.add_parser("report", help="redraw the table and plots of a run directory")
    rep.add_argument("run_dir")
    from meta_consensus import merge as merging  # light: imports jax only when a merge runs

    merging.add_parser(sub)
    models_cli.add_parser(sub)
    exp = sub.add_parser(
        "export",
        help="write a finished run's consensus as a Hugging Face folder (RUN/hf) and, for LoRA runs, a "
        "PEFT adapter (RUN/adapter)",
    )
    exp.add_argument("run_dir", metavar="RUN", help="the run folder, e.g. runs/smollm2")
    exp.add_argument("--out", metavar="DIR", help="write hf/ and adapter/ under DIR instead of RUN")
    _add_plugin_option(sub.choices["merge"])
    for command in sub.choices.values():
        _add_debug_option(command)
    return ap


def _set_device_flags(args: argparse.Namespace) -> None:
    # The CPU device count is read when jax creates its backends: set it before anything imports jax.
    if args.local_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.local_devices}".strip()
        )


def _start_jax(args: argparse.Namespace) -> None:
    # Collectives and jax.distributed must be set up before jax creates its backends.
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=120,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )


def _check_run_args(args: argparse.Namespace) -> None:
    """Argument combinations argparse cannot check, before jax starts."""
    if args.num_processes < 1:
        raise UserError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.num_processes > 1 and not args.coordinator:
        raise UserError("--num-processes > 1 needs --coordinator HOST:PORT")
    if not 0 <= args.process_id < args.num_processes:
        raise UserError(f"--process-id must be in [0, {args.num_processes - 1}], got {args.process_id}")
    if args.local_devices is not None and args.local_devices < 1:
        raise UserError(f"--local-devices must be >= 1, got {args.local_devices}")


def _last_checkpoint(run_dir: Path) -> str:
    ckpts = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    return f"round {steps[-1]} in {ckpts}" if steps else f"none in {ckpts}"


def _heartbeat_timeout(args: argparse.Namespace) -> int:
    """The config's ``heartbeat_timeout_s``, read before jax starts.

    The checked load comes after: jax.distributed must start before anything touches a device,
    and a bad value is reported then.
    """
    import tomllib

    from meta_consensus.config import Config, apply_overrides, default_text

    try:
        from meta_consensus.config import preset_text

        text = Path(args.config).read_text() if args.config else default_text()
        text = preset_text(args.preset) if args.preset else text
        value = apply_overrides(tomllib.loads(text), args.set).get("heartbeat_timeout_s")
        return int(value) if value is not None and int(value) >= 1 else Config.heartbeat_timeout_s
    except Exception:  # noqa: BLE001 - the real load below says what is wrong
        return Config.heartbeat_timeout_s


def run(args: argparse.Namespace) -> int:
    """``meta-consensus run``: load the config, train, print the table and where the outputs are.

    Args:
      args: the parsed ``run`` arguments.

    Returns:
      The exit code: 0, ``EXIT_NO_ROUND`` when no round succeeded, ``EXIT_SIGTERM`` when stopped
      by SIGTERM (a lost process in a multi-process run leaves with ``EXIT_PROCESS_LOST``).

    Raises:
      UserError: for a bad config, run directory, checkpoint, ``init_from`` or task.
    """
    _check_run_args(args)
    _set_device_flags(args)
    args.heartbeat_timeout = _heartbeat_timeout(args) if args.num_processes > 1 else None
    _start_jax(args)
    import jax

    from meta_consensus import config

    try:
        cfg, notes = config.load_with_notes(args.config, args.set, plugins=args.plugin, preset=args.preset)
        if args.init is not None:
            cfg = cfg.replace(init_from=args.init)
    except config.ConfigError as e:
        raise UserError(f"bad config: {e}") from e

    from consensus import io
    from consensus.base import ByzantineToleranceError
    from meta_consensus import MetaConsensus
    from meta_consensus.checkpoint import CheckpointError
    from meta_consensus.run import RunDirectoryError
    from strategies.tasks.checks import TaskError

    main = jax.process_index() == 0
    try:
        system = MetaConsensus(cfg, progress=not args.quiet)
    except TaskError as e:  # the user's model, data or task factory, checked before training
        raise UserError(str(e)) from e
    except ValueError as e:  # e.g. too many Byzantine nodes for the rule
        raise UserError(f"bad config: {e}") from e
    if main:
        for note in notes:
            print(f"meta-consensus: note: {note}")
        print(
            f"meta-consensus: run {cfg.name!r} -> {cfg.run_dir}/ "
            f"({cfg.rounds} rounds, {cfg.nodes.count} nodes)"
        )
    try:
        result = system.train(resume=args.resume, overwrite=args.overwrite)
    except (RunDirectoryError, CheckpointError) as e:
        raise UserError(str(e)) from e
    except (io.CheckpointError, io.CheckpointKeyError) as e:  # init_from does not fit the task
        raise UserError(f"init_from: {e}") from e
    except ByzantineToleranceError as e:  # the rule's precondition, checked when the state is built
        raise UserError(f"bad config: {e}") from e
    except Exception as e:
        if args.num_processes == 1:
            raise
        # A peer that died shows up here as a failed collective (gloo) or coordination call.
        if os.environ.get("META_CONSENSUS_TRACEBACK"):
            import traceback

            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(
            f"meta-consensus: process {jax.process_index()} of {args.num_processes} stopped "
            f"({type(e).__name__}: {first}); last checkpoint: {_last_checkpoint(cfg.run_dir)}; "
            "if a process was lost, restart every process with --resume "
            "(META_CONSENSUS_TRACEBACK=1 shows the traceback)",
            file=sys.stderr,
            flush=True,
        )
        # Leave without jax.distributed's shutdown barrier, which would wait for the lost process.
        os._exit(EXIT_PROCESS_LOST)
    if main:
        print(result.table(cfg))
        if result.stopped:
            print(f"stopped early: {result.stopped}")
        print(
            f"outputs: {cfg.run_dir}/ (config.toml, metrics.jsonl, tensorboard/, accuracy.png, weights.png, "
            "privacy.json, checkpoints/)"
        )
    if args.num_processes > 1:
        jax.distributed.shutdown()
    if result.terminated:
        if main:
            print(f"meta-consensus: stopped by SIGTERM: {result.stopped}", file=sys.stderr)
        return EXIT_SIGTERM
    if result.succeeded == 0:
        if main:
            print(
                f"meta-consensus: no round succeeded ({len(result.history)} attempts logged in "
                f"{cfg.run_dir / 'metrics.jsonl'})",
                file=sys.stderr,
            )
        return EXIT_NO_ROUND
    return 0


def report_cmd(args: argparse.Namespace) -> int:
    """``meta-consensus report``: the table and plots of a run directory, from its files.

    Args:
      args: the parsed ``report`` arguments (``run_dir``).

    Returns:
      0; the table is printed and written to ``table.txt``, the plots next to it.

    Raises:
      UserError: when the folder lacks ``config.toml`` or ``metrics.jsonl``, or either is unreadable.
    """
    from meta_consensus import config, report
    from meta_consensus.checkpoint import load_history

    run_dir = Path(args.run_dir)
    cfg_path, metrics = run_dir / "config.toml", run_dir / "metrics.jsonl"
    for p in (cfg_path, metrics):
        if not p.is_file():
            raise UserError(f"report: {p} not found (is {run_dir} a run directory?)")
    try:
        cfg = config.load(cfg_path)
    except config.ConfigError as e:
        raise UserError(f"report: {e}") from e
    try:
        history = load_history(metrics)
    except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(f"report: {metrics} is not a metrics log of this version ({e})") from e
    text = report.table(cfg, history)
    print(text)
    (run_dir / "table.txt").write_text(text + "\n")
    paths = report.plot(cfg, history, run_dir)
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def merge_cmd(args: argparse.Namespace) -> int:
    """``meta-consensus merge``: see :mod:`meta_consensus.merge`.

    Args:
      args: the parsed ``merge`` arguments.

    Returns:
      The merge command's exit code.

    Raises:
      UserError: for the merge's user errors (inputs, plan, plug-ins).
    """
    from meta_consensus import merge as merging

    _load_plugins(args.plugin)
    try:
        return merging.merge_cmd(args)
    except merging.user_errors() as e:
        raise UserError(str(e)) from e


def export_cmd(args: argparse.Namespace) -> int:
    """``meta-consensus export``: see :mod:`meta_consensus.export`.

    Args:
      args: the parsed ``export`` arguments (``run_dir``, ``out``).

    Returns:
      0; the folders written are printed, one per line.

    Raises:
      UserError: for a folder that is not a finished run of a Hugging Face model, or an output
        folder that exists.
    """
    from meta_consensus.export import ExportError, export_run

    try:
        done = export_run(args.run_dir, out=args.out)
    except ExportError as e:
        raise UserError(f"export: {e}") from e
    for note in done.notes:
        print(f"meta-consensus: {note}", file=sys.stderr)
    print(done.model)
    if done.adapter is not None:
        print(done.adapter)
    return 0


COMMANDS = {
    "run": run,
    "report": report_cmd,
    "merge": merge_cmd,
    "models": models_cli.models_cmd,
    "export": export_cmd,
}


def _check_environment() -> None:
    """Environment settings the package reads later, checked up front (a bad one is the user's)."""
    from kernels.columns import kernel_threads
    from kernels.compile_options import vector_width

    try:
        vector_width()
        kernel_threads()
    except ValueError as e:
        raise UserError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    """The ``meta-consensus`` command: parse the arguments and run the sub-command.

    A user error is one line on stderr and exit code 2 (``--debug`` adds the traceback).

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      The exit code: 0, 1 (no round succeeded or a process was lost), 2 (a user error), 130
      (interrupted) or 143 (SIGTERM).
    """
    args = _parser().parse_args(argv)
    try:
        _check_environment()
        return COMMANDS[args.command](args)
    except UserError as e:
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exception(e)
        return _fail(str(e))
    except KeyboardInterrupt:
        print("meta-consensus: interrupted; continue with --resume from the last checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
