"""Meshes, logical axis rules and shardings of stacked trees."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from consensus import mesh as mesh_lib


def test_make_mesh_shapes_and_errors():
    m = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=4, model=2))
    assert m.axis_names == ("node", "data", "model")
    assert dict(m.shape) == {"node": 4, "data": 1, "model": 2}
    # Devices are laid out node-major: a node's model shards are neighbouring devices.
    ids = np.vectorize(lambda d: d.id)(m.devices)
    np.testing.assert_array_equal(ids.reshape(-1), [d.id for d in jax.devices()[:8]])
    small = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=2))
    assert small.devices.size == 2
    with pytest.raises(ValueError, match="needs 16 devices"):
        mesh_lib.make_mesh(mesh_lib.MeshConfig(node=8, model=2))
    with pytest.raises(ValueError, match="positive int"):
        mesh_lib.MeshConfig(node=0)
    with pytest.raises(ValueError, match="bad logical axis rule"):
        mesh_lib.MeshConfig(rules=(("mlp", "tensor"),))


def test_logical_to_spec_rules():
    m = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=2, data=2, model=2))
    rules = mesh_lib.DEFAULT_RULES
    assert mesh_lib.logical_to_spec((64, 128), ("embed", "mlp"), m, rules) == (None, "model")
    assert mesh_lib.logical_to_spec((64, 128), ("embed", "mlp"), m, mesh_lib.FSDP_RULES) == ("data", "model")
    # Not divisible -> replicated; unknown names -> replicated; an axis is used once per leaf.
    assert mesh_lib.logical_to_spec((64, 3), ("embed", "mlp"), m, rules) == (None, None)
    assert mesh_lib.logical_to_spec((8, 8), ("whatever", None), m, rules) == (None, None)
    assert mesh_lib.logical_to_spec((8, 8), ("mlp", "heads"), m, rules) == ("model", None)
    # Missing trailing names mean replicated dims.
    assert mesh_lib.logical_to_spec((8, 8, 8), ("mlp",), m, rules) == ("model", None, None)
    # A mesh axis of size 1 never shards.
    m1 = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=8))
    assert mesh_lib.logical_to_spec((64, 128), ("embed", "mlp"), m1, rules) == (None, None)
    with pytest.raises(ValueError, match="reserved"):
        mesh_lib.logical_to_spec((8,), ("x",), m, (("x", "node"),))
    with pytest.raises(ValueError, match="more entries"):
        mesh_lib.logical_to_spec((8,), ("mlp", "embed"), m, rules)
    # First rule wins.
    assert mesh_lib.rules_dict((("a", "model"), ("a", "data"))) == {"a": "model"}


def test_stacked_sharding_places_and_round_trips():
    m = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=4, model=2))
    params = {"w": jnp.zeros((6, 8)), "b": jnp.zeros((8,)), "s": jnp.zeros(())}
    axes = {"w": ("embed", "mlp"), "b": ("mlp",), "s": ()}
    stacked = jax.tree.map(lambda p: jnp.stack([p + i for i in range(8)]), params)
    sh = mesh_lib.stacked_sharding(stacked, axes, m, mesh_lib.DEFAULT_RULES)
    assert sh["w"].spec == P("node", None, "model")
    assert sh["b"].spec == P("node", "model")
    assert sh["s"].spec == P("node")
    placed = mesh_lib.shard_stacked(stacked, sh)
    assert placed["w"].sharding.spec == P("node", None, "model")
    # Each device holds 2 nodes and half of the hidden units.
    assert placed["w"].addressable_shards[0].data.shape == (2, 6, 4)
    back = mesh_lib.unshard(placed)
    for k in params:
        np.testing.assert_array_equal(back[k], np.asarray(stacked[k]))
    with pytest.raises(ValueError, match="do not split"):
        mesh_lib.stacked_sharding(jax.tree.map(lambda x: x[:3], stacked), axes, m)
    with pytest.raises(ValueError, match="structure"):
        mesh_lib.stacked_sharding(stacked, {"w": ("embed", "mlp")}, m)
    # Unstacked params: replicated over "node", split over "model".
    psh = mesh_lib.param_sharding(params, axes, m)
    assert psh["w"].spec == P(None, "model")


def test_opt_state_sharding_mirrors_params():
    m = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=4, model=2))
    stacked = {"dense": {"kernel": jnp.zeros((4, 6, 8)), "bias": jnp.zeros((4, 8))}}
    axes = {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}}
    psh = mesh_lib.stacked_sharding(stacked, axes, m)
    opt = jax.eval_shape(jax.vmap(optax.adam(1e-3).init), stacked)
    osh = mesh_lib.opt_state_sharding(opt, stacked, psh, m)
    adam = osh[0]
    assert adam.mu["dense"]["kernel"].spec == P("node", None, "model")
    assert adam.nu["dense"]["bias"].spec == P("node", "model")
    assert adam.count.spec == P("node")


def test_global_from_local_single_process():
    m = mesh_lib.make_mesh(mesh_lib.MeshConfig(node=8))
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    g = mesh_lib.global_from_local(x, mesh_lib.node_sharding(m))
    assert g.sharding.spec == P("node") and len(g.addressable_shards) == 8
    np.testing.assert_array_equal(mesh_lib.to_host(g), x)
    r = mesh_lib.global_from_local(x, mesh_lib.replicated(m))
    assert r.sharding.is_fully_replicated
