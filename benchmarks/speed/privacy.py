"""Privacy accountants and the DP-FedAvg mechanism: speed, calibration, epsilon table.

Run ``python -m benchmarks privacy [--quick]``. Writes benchmarks/results/privacy.json and
privacy.md (``privacy_quick.*`` with --quick).

1. Accountant speed at q = 0.01, z = 1, delta = 1e-5 for 1, 100, 1,000 and 10,000 rounds:
   RDP and PLD (discretization 1e-4), against the targets (RDP < 50 ms at 1,000 rounds,
   PLD < 2 s). Baseline measured in the same run: the PLD composed one convolution per
   round (sequential) instead of by binary powers, at 100 rounds.
2. Calibration: time to find the smallest z for epsilon in {1, 3, 8} at q = 0.01 and 1,000
   rounds, for both accountants, and its ratio to one accountant evaluation.
3. The epsilon table over q in {0.01, 0.1, 1}, z in {0.5, 1, 2, 5}, rounds in {1, 100, 1000},
   delta = 1e-5, both accountants (PLD/RDP ratio: how much tighter PLD is). The PLD
   discretization is 1e-4 (1e-3 with --quick, and for cells whose epsilon is above 50,
   where 1e-4 only adds cost).
4. Mechanism overhead: one jitted dp_fedavg round (clip + noise + server step) against the
   plain uniform mean of the same stack (``tree.weighted_sum``), n = 16 nodes.

Not here yet: accuracy against epsilon in {1, 3, 8, inf}, which needs the node trainers.
"""

from __future__ import annotations

import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from consensus import dp, tree
from consensus.privacy import calibrate_noise, pld_epsilon, rdp_epsilon
from consensus.privacy.pld import DiscretePld, sampled_gaussian_pld

DELTA = 1e-5


def _median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def accountant_speed(quick: bool) -> dict:
    q, z = 0.01, 1.0
    rows = []
    for rounds in (1, 100, 1000, 10_000):
        t_rdp, e_rdp = _median_time(lambda r=rounds: rdp_epsilon(z, q, r, DELTA), 5 if quick else 11)
        t_pld, e_pld = _median_time(lambda r=rounds: pld_epsilon(z, q, r, DELTA, 1e-4), 1 if quick else 3)
        rows.append(dict(rounds=rounds, rdp_s=t_rdp, pld_s=t_pld, rdp_eps=e_rdp, pld_eps=e_pld))

    # Baseline: sequential composition, one FFT convolution per round.
    def sequential(rounds: int) -> float:
        rem, add = sampled_gaussian_pld(z, q, 1e-4)
        acc_r, acc_a = DiscretePld.identity(1e-4), DiscretePld.identity(1e-4)
        for _ in range(rounds):
            acc_r, acc_a = acc_r.compose(rem), acc_a.compose(add)
        return max(acc_r.epsilon(DELTA), acc_a.epsilon(DELTA))

    seq_rounds = 30 if quick else 100
    t_seq, e_seq = _median_time(lambda: sequential(seq_rounds), 1)
    t_pow, e_pow = _median_time(lambda: pld_epsilon(z, q, seq_rounds, DELTA, 1e-4), 1 if quick else 3)
    by_rounds = {r["rounds"]: r for r in rows}
    return dict(
        q=q,
        z=z,
        rows=rows,
        targets=dict(
            rdp_1000_s=by_rounds[1000]["rdp_s"],
            rdp_target_s=0.05,
            pld_max_s=max(r["pld_s"] for r in rows),
            pld_target_s=2.0,
        ),
        baseline=dict(
            rounds=seq_rounds,
            sequential_s=t_seq,
            binary_powers_s=t_pow,
            speedup=t_seq / t_pow,
            sequential_eps=e_seq,
            binary_powers_eps=e_pow,
        ),
    )


def calibration(quick: bool) -> list[dict]:
    q, rounds = 0.01, 1000
    out = []
    for target in (1.0, 3.0, 8.0):
        for acc in ("rdp", "pld"):
            h = 1e-3 if quick else 1e-4
            t_cal, z = _median_time(
                lambda a=acc, t=target, h=h: calibrate_noise(t, DELTA, q, rounds, a, discretization=h), 1
            )
            if acc == "rdp":
                t_one, eps = _median_time(lambda z=z: rdp_epsilon(z, q, rounds, DELTA), 3)
            else:
                t_one, eps = _median_time(lambda z=z, h=h: pld_epsilon(z, q, rounds, DELTA, h), 1)
            out.append(
                dict(
                    target=target,
                    accountant=acc,
                    z=z,
                    eps_at_z=eps,
                    calibrate_s=t_cal,
                    one_eval_s=t_one,
                    evals_equiv=t_cal / t_one,
                )
            )
    return out


def epsilon_table(quick: bool) -> list[dict]:
    out = []
    for q in (0.01, 0.1, 1.0):
        for z in (0.5, 1.0, 2.0, 5.0):
            for rounds in (1, 100, 1000):
                e_rdp = rdp_epsilon(z, q, rounds, DELTA)
                h = 1e-3 if (quick or e_rdp > 50) else 1e-4
                t0 = time.perf_counter()
                e_pld = pld_epsilon(z, q, rounds, DELTA, h)
                out.append(
                    dict(
                        q=q, z=z, rounds=rounds, rdp=e_rdp, pld=e_pld, pld_h=h, pld_s=time.perf_counter() - t0
                    )
                )
    return out


def mechanism(quick: bool) -> dict:
    n, d = 16, (200_000 if quick else 2_000_000)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(d,)), jnp.float32)}
    stacked = {"w": params["w"][None] + jnp.asarray(rng.normal(size=(n, d)) * 0.01, jnp.float32)}
    agg = dp.dp_fedavg(1.0, 1.0, key=0)
    state = agg.init(params)

    def dp_round():
        out, _ = agg.update(stacked, state, params)
        return jax.block_until_ready(out)

    w = jnp.full((n,), 1.0 / n, jnp.float32)
    plain = jax.jit(lambda s: tree.weighted_sum(s, w))

    def mean_round():
        return jax.block_until_ready(plain(stacked))

    dp_round(), mean_round()  # compile
    reps = 5 if quick else 15
    t_dp, _ = _median_time(dp_round, reps)
    t_mean, _ = _median_time(mean_round, reps)
    return dict(n=n, d=d, dp_fedavg_s=t_dp, plain_mean_s=t_mean, overhead=t_dp / t_mean)


def _markdown(res: dict) -> str:
    lines = ["# Privacy accountants and DP-FedAvg", ""]
    lines.append(f"Machine: {res['machine']}; quick={res['quick']}; delta = {DELTA:g}.")
    lines.append("")
    sp = res["speed"]
    lines.append(f"## Accountant speed (q = {sp['q']}, z = {sp['z']}, PLD discretization 1e-4)")
    lines.append("")
    lines.append("| rounds | RDP time | PLD time | RDP eps | PLD eps |")
    lines.append("|---:|---:|---:|---:|---:|")
    for r in sp["rows"]:
        lines.append(
            f"| {r['rounds']} | {r['rdp_s'] * 1e3:.1f} ms | {r['pld_s']:.3f} s | "
            f"{r['rdp_eps']:.4f} | {r['pld_eps']:.4f} |"
        )
    t = sp["targets"]
    lines.append("")
    lines.append(
        f"Targets: RDP at 1,000 rounds {t['rdp_1000_s'] * 1e3:.1f} ms (target 50 ms, ratio "
        f"{t['rdp_1000_s'] / t['rdp_target_s']:.2f}); slowest PLD {t['pld_max_s']:.2f} s (target 2 s, ratio "
        f"{t['pld_max_s'] / t['pld_target_s']:.2f})."
    )
    b = sp["baseline"]
    lines.append(
        f"Baseline, {b['rounds']} rounds: sequential composition {b['sequential_s']:.2f} s vs binary powers "
        f"{b['binary_powers_s']:.3f} s (speed-up {b['speedup']:.1f}x; eps {b['sequential_eps']:.5f} vs "
        f"{b['binary_powers_eps']:.5f})."
    )
    lines.append("")
    lines.append("## Calibration (q = 0.01, 1,000 rounds)")
    lines.append("")
    lines.append("| target eps | accountant | z | eps(z) | time | x one evaluation |")
    lines.append("|---:|---|---:|---:|---:|---:|")
    for c in res["calibration"]:
        lines.append(
            f"| {c['target']:g} | {c['accountant']} | {c['z']:.4f} | {c['eps_at_z']:.4f} | "
            f"{c['calibrate_s']:.3f} s | {c['evals_equiv']:.1f} |"
        )
    lines.append("")
    lines.append("## Epsilon table (delta = 1e-5)")
    lines.append("")
    lines.append("| q | z | rounds | RDP eps | PLD eps | PLD / RDP | PLD h | PLD time |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["table"]:
        lines.append(
            f"| {r['q']:g} | {r['z']:g} | {r['rounds']} | {r['rdp']:.4g} | {r['pld']:.4g} | "
            f"{r['pld'] / r['rdp']:.3f} | {r['pld_h']:g} | {r['pld_s']:.2f} s |"
        )
    m = res["mechanism"]
    lines.append("")
    lines.append(f"## Mechanism overhead (n = {m['n']}, d = {m['d']:,} float32)")
    lines.append("")
    lines.append(
        f"dp_fedavg round {m['dp_fedavg_s'] * 1e3:.2f} ms vs plain uniform mean "
        f"{m['plain_mean_s'] * 1e3:.2f} ms "
        f"(ratio {m['overhead']:.2f})."
    )
    lines.append("")
    lines.append("Accuracy against epsilon in {1, 3, 8, inf} needs the node trainers: not measured yet.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, "fewer repeats, coarser PLD grid (under a minute)")
    args = harness.parse(parser, argv)
    t0 = time.perf_counter()
    res = dict(
        quick=args.quick,
        machine=f"{platform.processor() or platform.machine()}, {jax.device_count()} JAX device(s), "
        f"backend {jax.default_backend()}",
        speed=accountant_speed(args.quick),
        calibration=calibration(args.quick),
        table=epsilon_table(args.quick),
        mechanism=mechanism(args.quick),
    )
    res["total_s"] = time.perf_counter() - t0
    jpath, mpath = harness.save("privacy", args.quick, res, _markdown(res), settings={"quick": args.quick})
    print(_markdown(res))
    print(f"total {res['total_s']:.1f} s -> {jpath}, {mpath}")
    return res


if __name__ == "__main__":
    main()
