r"""The ``merge`` subcommand's command line: its arguments, the plan they give, and the command.

::

    meta-consensus merge --method trimmed_mean --num-byzantine 1 --out merged/ a.safetensors b/ c/ d/
    meta-consensus merge --method krum --num-byzantine 1 --override '^head\.=median' --out merged/ IN...
    meta-consensus merge --config merge.toml

Options that change which rules exist (``--plugin``) rather than the plan come after
:func:`add_parser`'s own and are applied before :func:`merge_cmd` reads the plan; a
config file's ``plugins = [...]`` are imported before the plan's rules are checked.
"""

from __future__ import annotations

from typing import Any

from meta_consensus.merge.engine import merge_checkpoints
from meta_consensus.merge.errors import MergeError
from meta_consensus.merge.plan import (
    MergePlan,
    RuleChoice,
    parse_override,
    parse_sets,
    parse_shard_size,
    parse_weights,
    plan_from_toml,
)
from meta_consensus.merge.report import REPORT_NAME


def add_parser(sub: Any) -> None:
    """Register the ``merge`` subcommand on the CLI's subparsers.

    Args:
      sub: The ``argparse`` subparsers action of ``meta-consensus``.
    """
    p = sub.add_parser(
        "merge",
        help="merge checkpoints (safetensors files or folders, or this package's orbax checkpoints) "
        "with a registered rule",
    )
    # the plan: inputs, rules, output
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="checkpoints: .safetensors files, sharded safetensors folders, or orbax checkpoints of "
        "this package (a <run>/checkpoints/<round> folder, or a checkpoints or run folder: its latest "
        "round; the consensus is merged); kinds may be mixed",
    )
    p.add_argument(
        "--method",
        help="a merge method: a rule of consensus.registry.RULES that maps n inputs to one (linear, "
        "task_arithmetic, ties, dare_ties, dare_linear, slerp, model_stock, karcher_mean, median, "
        "trimmed_mean, krum, ...; an unknown name lists them all)",
    )
    p.add_argument("--num-byzantine", "-f", type=int, default=None, help="f, for the rules that take one")
    p.add_argument(
        "--set", action="append", default=[], metavar="method.PARAM=VALUE", help="a rule parameter"
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PATTERN=METHOD[,PARAM=VALUE...]",
        help="another rule for the keys a regex matches, e.g. '^head\\.=median' (first match wins)",
    )
    p.add_argument(
        "--base", help="the common base model, any input kind (needed by merge methods over task vectors)"
    )
    p.add_argument("--out", help="output folder (must not exist)")
    p.add_argument(
        "--dtype",
        help="output dtype of float tensors (default: the inputs'; needed when they differ: fp32 and bf16)",
    )
    p.add_argument(
        "--config-from",
        metavar="DIR",
        help="Hugging Face model folder whose config.json, generation config and tokenizer files the "
        "output gets (default: the first input, when it is one)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="an input holding NaN or Inf is an error (default: left out of that tensor and named on stderr)",
    )
    p.add_argument("--shard-size", help="shard the output above this size, e.g. 2GB")
    p.add_argument(
        "--seed", type=int, default=None, help="seed of randomized rules (dare_*, signguard, ...; default 0)"
    )
    p.add_argument(
        "--weights",
        metavar="W1,W2,...",
        help="one weight per input, in order (linear, task_arithmetic, ties, dare_*, karcher_mean, ...)",
    )
    p.add_argument(
        "--merge-into-base",
        metavar="BASE",
        help="PEFT adapter inputs: write BASE (a Hugging Face model folder) with the merged update added, "
        "instead of an adapter folder",
    )
    p.add_argument(
        "--adapter-method",
        metavar="NAME",
        help="PEFT adapter inputs with a robust --method (krum, median, ...): how the nodes are then "
        "combined (stack, svd, exact_residual, fedit, ffa, cat; default stack after a vector rule, "
        "svd after a coordinate-wise one, fedit with --space factors)",
    )
    p.add_argument(
        "--space",
        choices=("products", "factors"),
        default=None,
        help="PEFT adapter inputs: where a robust rule works, on the updates B A (exact; default) or on "
        "the factors (cheap; the factorisation is not unique)",
    )
    p.add_argument("--config", help="merge TOML file (command-line options win)")
    p.add_argument(
        "--mergekit-config",
        metavar="YAML",
        help="a mergekit configuration (models or slices, base_model, merge_method, parameters, dtype; "
        "several YAML documents: mergekit-multi stages); --out is still needed",
    )
    p.add_argument(
        "--compute-dtype",
        choices=("float32", "config"),
        default=None,
        help="--mergekit-config: compute in float32 and cast once (default: closest to the exact merge), "
        "or in the config's dtype with every intermediate rounded, as mergekit does (the same bits)",
    )
    # how the command runs
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    # Which rules exist: ``--plugin MODULE`` (user modules that declare more) is added after
    # these by meta_consensus.cli, one option shared with ``run``, and its modules are loaded
    # before merge_cmd reads the plan, so the plan's checks see their rules.


def plan_from_args(args: Any) -> Any:
    """Build the plan the parsed arguments give (over ``--config``'s or ``--mergekit-config``'s).

    Args:
      args: The parsed ``merge`` arguments.

    Returns:
      The plan, not yet checked (:func:`~meta_consensus.merge.plan.check_plan`); for
      ``--mergekit-config``, what :func:`~meta_consensus.merge.mergekit.read_mergekit` returns (a
      plan, a tensor-by-tensor job or a multi-merge).

    Raises:
      MergeError: If no method is given (and no config), ``--mergekit-config`` comes with
        ``--config``, ``--method`` or inputs, or an option is malformed (``--set``,
        ``--override``, ``--weights``, ``--shard-size``), or the config file is.
    """
    overrides = [parse_override(o) for o in args.override]
    values = {
        "method": args.method,
        "params": parse_sets(args.set),
        "num_byzantine": args.num_byzantine,
        "inputs": list(args.inputs),
        "out": args.out,
        "base": args.base,
        "dtype": args.dtype,
        "shard_size": args.shard_size,
        "seed": args.seed,
        "weights": args.weights,
        "overrides": overrides,
        "merge_into_base": getattr(args, "merge_into_base", None),
        "adapter_method": getattr(args, "adapter_method", None),
        "space": getattr(args, "space", None),
        # --plugin's modules (meta_consensus.cli has loaded them): the report records them with the file's
        "plugins": list(getattr(args, "plugin", None) or []),
    }
    if getattr(args, "mergekit_config", None):
        from meta_consensus.merge.mergekit import read_mergekit

        if args.config or args.method or args.inputs:
            raise MergeError(
                "--mergekit-config gives the method and the inputs: drop --config, --method and INPUT"
            )
        return read_mergekit(args.mergekit_config, compute=getattr(args, "compute_dtype", None), **values)
    if getattr(args, "compute_dtype", None):
        raise MergeError("--compute-dtype is for --mergekit-config")
    if args.config:
        return plan_from_toml(args.config, **values)
    if not args.method:
        raise MergeError("give --method NAME (or --config merge.toml)")
    weights = parse_weights(args.weights)
    params = values["params"] if weights is None else {**values["params"], "weights": list(weights)}
    return MergePlan(
        inputs=tuple(args.inputs),
        out=args.out or "",
        rule=RuleChoice(args.method, params, args.num_byzantine),
        overrides=tuple(overrides),
        base=args.base,
        dtype=args.dtype,
        shard_size=parse_shard_size(args.shard_size),
        seed=args.seed or 0,
        plugins=tuple(dict.fromkeys(values["plugins"])),
        merge_into_base=values["merge_into_base"],
        adapter_method=values["adapter_method"],
        space=values["space"] or "products",
    )


class Interrupted(Exception):
    """SIGTERM (or SIGINT) during a merge, raised in the main thread so the partial output is removed.

    Args:
      signum: The signal's number.

    Attributes:
      signum: The signal's number (the command exits 128 + it).
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def merge_cmd(args: Any) -> int:
    """The ``merge`` subcommand: 0 on success; user errors raise (the CLI prints one line, exit 2).

    SIGINT and SIGTERM stop the merge, remove the partial output (written to a temporary folder
    until the end) and exit 128 + the signal's number; nothing is kept to continue from.

    Args:
      args: The parsed ``merge`` arguments.

    Returns:
      The exit status: 0, or 128 + the signal's number when stopped. Inputs that held NaN or
      Inf are named on stderr as warnings.

    Raises:
      MergeError: For a user error (and the other types of
        :func:`~meta_consensus.merge.errors.user_errors`), which the CLI prints as one line and
        exits 2.
    """
    import signal
    import sys
    import threading

    plan = plan_from_args(args)

    def stop(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    # Our own handler for both signals: a process may inherit SIGINT ignored (a pytest-xdist worker,
    # a non-interactive shell's background job), and the partial output must go all the same.
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, stop) for s in handled} if main_thread else {}
    try:
        if getattr(args, "mergekit_config", None):
            from meta_consensus.merge.mergekit_run import run_any

            report = run_any(
                plan,
                progress=not args.quiet,
                strict=getattr(args, "strict", False),
                config_from=getattr(args, "config_from", None),
                config_path=args.mergekit_config,
            )
        else:
            report = merge_checkpoints(
                plan,
                progress=not args.quiet,
                strict=getattr(args, "strict", False),
                config_from=getattr(args, "config_from", None),
            )
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else int(signal.SIGINT)
        print(
            f"meta-consensus merge: stopped by {signal.Signals(signum).name}; the partial output was "
            f"removed, nothing was written to {plan.out}",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        for signum_, handler in previous.items():
            signal.signal(signum_, signal.SIG_DFL if handler is None else handler)
    for name, keys in report["nonfinite"].items():
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        print(
            f"meta-consensus merge: warning: {name} holds NaN or Inf in {len(keys)} tensor(s) ({shown}); "
            "it was left out of them (--strict makes this an error)",
            file=sys.stderr,
        )
    flagged = f" ({len(report['nonfinite'])} with NaN or Inf, see above)" if report["nonfinite"] else ""
    print(
        f"meta-consensus merge: {len(plan.inputs)} inputs{flagged}, {len(report['leaves'])} tensors, "
        f"method {report.get('method') or plan.rule.method} -> {plan.out}/ ({REPORT_NAME})"
    )
    return 0
