"""Rules are declared once, beside their factories: the registry, the docs table, the runtime checks
and a pipeline's capabilities all read the declaration (``@RULES.declare``, consensus/specs.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import consensus
from consensus import registry
from consensus.aggregators import view as views
from consensus.aggregators._common import check_count, init_rule_state
from consensus.aggregators.compose import reads_views, view_centre
from consensus.base import AggregationInfo, Aggregator, ByzantineToleranceError
from consensus.specs import RULES, at_least, exactly, least_count, need

KEY = jax.random.key(3)


def _nodes(n: int, seed: int = 0, d: int = 6):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(d,)).astype(np.float32)}
    stacked = {"w": (params["w"][None] + rng.normal(size=(n, d))).astype(np.float32)}
    return params, stacked


def test_docs_rules_table_is_rendered_from_the_declarations():
    page = registry.DOCS_PAGE.read_text()
    assert registry.render_page(page) == page, (
        f"docs/rules.md's rules table differs from the declarations: run `{registry.DOCS_COMMAND}`"
    )


def test_every_built_rule_carries_its_declaration():
    for name, spec in RULES.items():
        params = {k: {"density": 0.5, "t": 0.5}[k] for k in spec.required}
        built = registry.make(name, 1 if spec.takes_f else None, **params)
        assert built.spec is spec, name
        assert spec.module.startswith(("consensus.aggregators.", "consensus.merging.")), name
    assert consensus.krum(1).spec is RULES["krum"]


def test_capabilities_are_data_on_the_spec():
    assert RULES["krum"].reads_views and RULES["median"].reads_views
    assert not RULES["dnc"].reads_views
    assert RULES["task_arithmetic"].reads_dropped and not RULES["ties"].reads_dropped
    assert [view_centre(registry.make(p, 1)) for p in ("clip", "nnm", "arc")] == ["zero", "none", "median"]
    assert view_centre(consensus.clip(1.0)._replace(spec=None)) == "median"

    params, stacked = _nodes(7)
    seen = []

    def spy(x, state, params=None, *, mask=None, **extra):
        seen.append(views.is_view(x))
        return consensus.median().update(x, state, params, mask=mask)

    declared = consensus.median()._replace(update=spy)  # keeps median's spec: reads views
    by_hand = Aggregator(declared.init, spy, "by_hand")  # no spec: gets the view materialised
    assert reads_views(declared) and not reads_views(by_hand)
    outs = []
    for rule in (declared, by_hand):
        pipe = consensus.process(rule, pre=[consensus.clip(1.0), consensus.nnm(1)])
        merged, _ = pipe.update(stacked, pipe.init(params), params)
        outs.append(np.asarray(merged["w"]))
    assert seen == [True, False]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", ["krum", "geometric_median", "median", "trimmed_mean"])
def test_bucketing_by_name_equals_bucketing_of_the_built_rule(inner):
    f = 1
    params, stacked = _nodes(12, seed=4)
    spec = RULES[inner]
    by_name = consensus.bucketing(f, inner=inner)
    built = consensus.bucketing(f, inner=spec.build(f if spec.takes_f else None))
    for p in (params, None):
        a, sa = by_name.update(stacked, by_name.init(p), p, key=KEY)
        b, sb = built.update(stacked, built.init(p), p, key=KEY)
        np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
        for x, y in zip(consensus.get_info(sa), consensus.get_info(sb), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bucketing_checks_a_built_inner_rule_as_it_checks_a_name():
    params, stacked = _nodes(16)
    for rule in (consensus.bucketing(3, inner="krum"), consensus.bucketing(3, inner=consensus.krum(3))):
        with pytest.raises(ByzantineToleranceError, match="the inner krum on the buckets"):
            rule.update(stacked, rule.init(params), params, key=KEY)
    with pytest.raises(ValueError, match="plain n -> 1 rule"):
        consensus.bucketing(1, inner=consensus.dnc(1))


@pytest.mark.parametrize(
    "name", ["trimmed_mean", "krum", "multi_krum", "bulyan", "caf", "meamed", "nnm", "arc"]
)
def test_the_runtime_check_is_the_declared_precondition(name):
    """The rule refuses with the very text of its declaration's check, on n and on the valid count m."""
    spec = RULES[name]
    f = 2
    n = next(k for k in range(1, 30) if spec.requirement(k, f) is None)
    params, stacked = _nodes(n)
    rule = spec.build(f)
    with pytest.raises(ByzantineToleranceError) as declared:
        spec.check(n - 1, f)
    small = {"w": stacked["w"][: n - 1]}
    with pytest.raises(ByzantineToleranceError) as on_n:
        rule.update(small, rule.init(params), params)
    assert str(on_n.value) == str(declared.value)
    mask = jnp.arange(n) > 0  # n nodes, n - 1 valid
    with pytest.raises(ByzantineToleranceError) as on_m:
        rule.update(stacked, rule.init(params), params, mask=mask)
    assert str(on_m.value) == str(declared.value)


@pytest.mark.parametrize("name", ["krum", "multi_krum", "bulyan", "caf", "meamed", "dnc", "server_monna"])
def test_under_jit_a_failed_precondition_gives_nan(name):
    spec = RULES[name]
    f = 1
    n = next(k for k in range(1, 30) if spec.requirement(k, f) is None)
    params, stacked = jax.tree.map(jnp.asarray, _nodes(n))
    rule = spec.build(f, **({"num_selected": 1} if name == "multi_krum" else {}))
    extra = {"key": KEY, "server_update": {"w": np.ones(6, np.float32)}}
    extra = {k: v for k, v in extra.items() if k in spec.needs}

    def run(mask):
        return rule.update(stacked, rule.init(params), params, mask=mask, **extra)[0]["w"]

    fine = jax.jit(run)(jnp.ones(n, bool))
    short = jax.jit(run)(jnp.arange(n) > 0)
    assert np.isfinite(np.asarray(fine)).all() and np.isnan(np.asarray(short)).all()


def test_least_count_reads_the_precondition():
    assert least_count(at_least(2), 0, 5) == 2
    assert least_count(RULES["krum"].precondition, 2, 10) == 7
    assert least_count(RULES["bulyan"].precondition, 1, 6) == 7  # none up to 6
    assert least_count(exactly(2), 0, 3) == 2
    assert at_least(3) is at_least(3)


def test_a_rule_declared_elsewhere_is_at_once_buildable_documented_and_checked():
    def three_f(n: int, f: int) -> str | None:
        return need(n > 3 * f, f"n > 3f = {3 * f}")

    @RULES.declare(kind="coordinatewise", takes_f=True, precondition=three_f, elementwise=True)
    def toy_mean(num_byzantine: int, scale: float = 1.0) -> Aggregator:
        """A toy rule: the scaled mean, refused below n > 3f."""
        f = num_byzantine

        def update(stacked, state, params=None, *, mask=None, **extra):
            n = stacked["w"].shape[0]
            check_count("toy_mean", three_f, f, n)
            w = jnp.full((n,), 1.0 / n)
            info = AggregationInfo(jnp.ones(n, bool), jnp.ones(n, bool), w)
            return {"w": scale * jnp.mean(stacked["w"], axis=0)}, init_rule_state()._replace(info=info)

        return Aggregator(init_rule_state, update, "toy_mean")

    try:
        spec = RULES["toy_mean"]
        assert spec.module == __name__ and spec.summary.startswith("A toy rule")
        rule = registry.make("toy_mean", 1, scale=2.0)
        assert rule.spec is spec
        assert "toy_mean" in registry.vote_rules()
        row = next(r for r in registry.markdown_table().splitlines() if r.startswith("| `toy_mean` |"))
        assert "| n > 3f |" in row and "scale=1.0" in row and f"`{__name__}`" in row
        params, stacked = _nodes(4)
        merged, _ = rule.update(stacked, rule.init(params), params)
        np.testing.assert_allclose(np.asarray(merged["w"]), 2.0 * stacked["w"].mean(0), rtol=1e-6)
        with pytest.raises(
            ByzantineToleranceError, match=r"toy_mean: .*f=1.*n=3 valid nodes; needs n > 3f = 3\."
        ):
            spec.check(3, 1)
        with pytest.raises(
            ByzantineToleranceError, match=r"toy_mean: .*f=1.*n=3 valid nodes; needs n > 3f = 3\."
        ):
            rule.update({"w": stacked["w"][:3]}, rule.init(params), params)
        with pytest.raises(registry.RegistryError, match="takes no parameter"):
            registry.make("toy_mean", 1, nope=1)
    finally:
        RULES.unregister("toy_mean")
    assert "toy_mean" not in RULES and "toy_mean" not in registry.markdown_table()
