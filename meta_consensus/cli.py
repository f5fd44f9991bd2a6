"""The ``meta-consensus`` command (also ``python -m meta_consensus``).

::

    meta-consensus run [--config FILE] [--set key=value ...] [--resume] [--quiet]
    meta-consensus report runs/<name>

``run`` with no arguments runs the embedded default (digits, 8 nodes with mixed
strategies, 2 ALIE attackers, Multi-Krum vote, mixture-NLL convex weights, DP).
A multi-process run starts the same command once per process with
``--coordinator HOST:PORT --num-processes P --process-id I``
(``jax.distributed``); each process hosts a block of the nodes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meta-consensus", description="Model merging by consensus on JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the rounds of a config (default: the embedded demo)")
    run.add_argument("--config", help="TOML config file (default: the embedded default)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rounds=5 --set vote.rule=median",
    )
    run.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
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
    return ap


def _start_jax(args: argparse.Namespace) -> None:
    # Device count and collectives must be set before jax creates its backends.
    if args.local_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.local_devices}".strip()
        )
    import jax

    if args.num_processes > 1:
        if not args.coordinator:
            raise SystemExit("meta-consensus: --num-processes > 1 needs --coordinator HOST:PORT")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=120,
        )


def run(args: argparse.Namespace) -> int:
    _start_jax(args)
    import jax

    from meta_consensus import MetaConsensus, config

    try:
        cfg = config.load(args.config, args.set)
    except config.ConfigError as e:
        print(f"meta-consensus: bad config: {e}", file=sys.stderr)
        return 2
    main = jax.process_index() == 0
    if main:
        print(
            f"meta-consensus: run {cfg.name!r} -> {cfg.run_dir}/ "
            f"({cfg.rounds} rounds, {cfg.nodes.count} nodes)"
        )
    try:
        system = MetaConsensus(cfg, progress=not args.quiet)
    except ValueError as e:  # e.g. too many Byzantine nodes for the rule
        print(f"meta-consensus: bad config: {e}", file=sys.stderr)
        return 2
    result = system.train(resume=args.resume)
    if main:
        print(result.table(cfg))
        if result.stopped:
            print(f"stopped early: {result.stopped}")
        print(
            f"outputs: {cfg.run_dir}/ (config.toml, metrics.jsonl, tensorboard/, accuracy.png, weights.png, "
            "checkpoints/)"
        )
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


def report_cmd(args: argparse.Namespace) -> int:
    from meta_consensus import config, report
    from meta_consensus.checkpoint import load_history

    run_dir = Path(args.run_dir)
    cfg_path, metrics = run_dir / "config.toml", run_dir / "metrics.jsonl"
    for p in (cfg_path, metrics):
        if not p.is_file():
            print(f"meta-consensus report: {p} not found (is {run_dir} a run directory?)", file=sys.stderr)
            return 2
    cfg = config.load(cfg_path)
    history = load_history(metrics)
    text = report.table(cfg, history)
    print(text)
    (run_dir / "table.txt").write_text(text + "\n")
    paths = report.plot(cfg, history, run_dir)
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return run(args)
    return report_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
