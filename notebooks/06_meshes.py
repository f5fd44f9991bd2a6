# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Meshes and multi-host
#
# The coordinator's stacked trees and the node trainer run on a device mesh with axes
# `("node", "data", "model")`: nodes are split over `"node"`, a node's batch over `"data"` and its
# model dimensions over `"model"` (tensor parallel), following the model's logical axis names.
# This notebook simulates 8 CPU devices, places a stacked tree on the mesh, checks that a sharded
# aggregation equals the unsharded one, trains nodes on the mesh, and explains how the same code
# runs across several hosts.

# %%
import os

# Simulate 8 CPU devices. Must run before jax is imported (other XLA flags are kept).
flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

# META_CONSENSUS_SMALL=1 (set by the test suite) picks small settings so the notebook runs in seconds.
SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np
import optax

import consensus
from strategies import DigitsTask, NodeTrainer

# The flag above only works before jax's first import; restart the kernel if this fails.
assert jax.device_count() == 8, jax.devices()
NUM_NODES = 8
STEPS = 100 if SMALL else 300
HIDDEN = (32,) if SMALL else (64,)

# %% [markdown]
# ## A mesh
#
# `MeshConfig(node=4, model=2)`: 4 groups of 2 devices; each group hosts 2 of the 8 nodes and
# splits every node's hidden layer in two.

# %%
config = consensus.MeshConfig(node=4, model=2)
mesh = consensus.make_mesh(config)
print(mesh)
print("logical axis rules:", config.resolved_rules)

# %% [markdown]
# ## Placing a stacked tree on the "node" axis
#
# We train 8 nodes without a mesh (the reference), then place the stacked params with
# `consensus.stacked_sharding`: every leaf gets `P("node", *its own spec)` from the task's logical
# axis names (`"mlp"` -> `"model"`; `"embed"` and `"classes"` replicated).

# %%
task = DigitsTask(hidden=HIDDEN)
data = task.splits(NUM_NODES, seed=0, alpha=0.5)
global_params = task.init(jax.random.key(0))
trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
ref_state = trainer.init(jax.random.key(1), global_params, NUM_NODES)
ref_state, _ = trainer.fit(ref_state, data.own(), STEPS)
host_stack = jax.device_get(ref_state.params)  # numpy arrays on the host

logical = task.logical_axes()
shardings = consensus.stacked_sharding(host_stack, logical, mesh, config)
placed = jax.device_put(host_stack, shardings)
# The global params: replicated over "node", split over "model" like one node's params.
global_sharding = consensus.mesh.param_sharding(global_params, logical, mesh, config)
global_placed = jax.device_put(global_params, global_sharding)
for path, leaf in jax.tree_util.tree_leaves_with_path(placed):
    print(f"{jax.tree_util.keystr(path):24s} {str(leaf.shape):14s} {leaf.sharding.spec}")

# %%
# Which device holds which (node, hidden unit) block of the first layer's kernel?
kernel = placed["dense_0"]["kernel"]  # (node, 64 inputs, hidden)
owner = np.zeros((kernel.shape[0], kernel.shape[2]), int)
for shard in kernel.addressable_shards:
    nodes, _, units = shard.index
    owner[nodes, units] = shard.device.id
fig, ax = plt.subplots(figsize=(7, 3))
ax.imshow(owner, cmap="tab10", vmin=0, vmax=9, aspect="auto", interpolation="nearest")
for shard in kernel.addressable_shards:
    nodes, _, units = shard.index
    centre = ((units.start + units.stop - 1) / 2, (nodes.start + nodes.stop - 1) / 2)
    ax.text(*centre, f"device {shard.device.id}", ha="center", va="center", color="white")
ax.set(
    xlabel="hidden unit (split over 'model')",
    ylabel="node (split over 'node')",
    title="device holding each block of dense_0/kernel",
)
plt.show()


# %% [markdown]
# ## Aggregating a sharded stack
#
# A rule's `update` runs under `jax.jit` on the sharded stack as it is, and XLA's partitioner adds
# the communication: a coordinate-wise rule (median) needs all `n` values of a coordinate on one
# device, a Gram rule (Krum) only needs the `n x n` Gram matrix summed across devices. The result
# must equal the same rule on one device.


# %%
def merged_by(agg):
    return jax.jit(lambda stacked, params: agg.update(stacked, agg.init(params), params)[0])


one_device = jax.devices()[0]
max_diff = {}
for name, agg in {"median": consensus.median(), "krum": consensus.krum(num_byzantine=2)}.items():
    run = merged_by(agg)
    sharded = run(placed, global_placed)
    unsharded = run(jax.device_put(host_stack, one_device), jax.device_put(global_params, one_device))
    max_diff[name] = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True)
    )
    print(
        f"{name:6s} max |sharded - unsharded| = {max_diff[name]:.2e}; "
        f"output dense_0/kernel sharding {sharded['dense_0']['kernel'].sharding.spec}"
    )

# %% [markdown]
# ## NodeTrainer on a mesh
#
# Give the trainer the `MeshConfig` and it places the stacked params, optimizer state, keys and
# per-node data on the mesh; XLA partitions the same program. With the same keys it reproduces the
# reference run up to float32 rounding.

# %%
mesh_trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32, mesh=config)
mesh_state = mesh_trainer.init(jax.random.key(1), global_params, NUM_NODES)
mesh_state, _ = mesh_trainer.fit(mesh_state, data.own(), STEPS)
train_diff = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(mesh_state.params), jax.tree.leaves(host_stack), strict=True)
)
print("trained params sharding:", jax.tree.map(lambda x: x.sharding.spec, mesh_state.params))
print(f"max |mesh - reference| = {train_diff:.2e}")
mesh_acc = mesh_trainer.evaluate(mesh_state.params, data.test)["accuracy"]
print("test accuracy per node:", mesh_acc.round(3))

# %% [markdown]
# ## Multi-host
#
# Across machines the code above stays the same; only the start-up and the data loading change.
# Every process runs the same script:
#
# ```python
# import jax
# jax.distributed.initialize(coordinator_address="host0:1234", num_processes=P, process_id=p)
# # on CPU clusters: jax.config.update("jax_cpu_collectives_implementation", "gloo") first
#
# config = consensus.MeshConfig(node=jax.device_count() // model, model=model)
# mesh = consensus.make_mesh(config)  # over every process's devices, process by process
# data = task.splits(num_nodes, seed=0, process_index=jax.process_index(),
#                    process_count=jax.process_count())  # only this process's nodes
# trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, mesh=config)
# state = trainer.init(jax.random.key(0), params, num_nodes)  # num_nodes over all processes
# state, log = trainer.fit(state, data.own(), steps)
# ```
#
# * The mesh is built over `jax.devices()`, so the `"node"` axis is split into contiguous blocks,
#   one per process; `task.splits(..., process_index=p, process_count=P)` returns exactly the
#   shards of the nodes process `p` hosts (a contiguous block of node ids), never another
#   process's examples.
# * `NodeTrainer` assembles global arrays from each process's block
#   (`jax.make_array_from_process_local_data`); every process passes the *same* key and initial
#   params.
# * Gathering (`consensus.mesh.to_host`) is collective: every process calls it; only process 0
#   should log and write files. Orbax checkpoints are written collectively.
#
# `tests/strategies/test_multihost.py` launches two such processes on one machine (4 simulated
# CPU devices each, gloo collectives, `tests/strategies/multihost_worker.py`) and checks that
# their shards are disjoint and that the trained params equal a single-process run on 8 devices.
# A notebook is one process, so it does not launch them.

# %% [markdown]
# ## Checks

# %%
assert max(max_diff.values()) < 1e-5, max_diff
assert train_diff < 1e-4, train_diff
assert mesh_state.params["dense_0"]["kernel"].sharding.spec == shardings["dense_0"]["kernel"].spec
assert len(np.unique(owner)) == 8  # every device holds a block
print("all checks passed")
