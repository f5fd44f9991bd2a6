"""meta-consensus, node side: tasks, the node trainer and the per-node strategies.

* :mod:`strategies.tasks` - digits (Flax NNX MLP) and text (byte-level transformer) tasks;
* :mod:`strategies.trainer` - n stacked nodes trained by one jitted step on a mesh;
* :mod:`strategies.models` - Hugging Face causal LMs (Llama, Mistral, Qwen2, GPT-2) in flax.nnx;
* :mod:`strategies.hierarchical` - curriculum levels: general, specialized, fine-tuning data;
* :mod:`strategies.convexity` - proximal / L2-ball constrained training and loss barriers;
* :mod:`strategies.soup` - uniform, weighted and greedy incremental soups;
* :mod:`strategies.attacks`, :mod:`strategies.byzantine` - Byzantine attacks and Byzantine nodes.
"""

from strategies import attacks, byzantine, convexity, hierarchical, soup, tangent, tasks, trainer
from strategies.attacks import ATTACKS, apply_attack, get_attack
from strategies.byzantine import Byzantine, byzantine_fit
from strategies.convexity import (
    BarrierReport,
    anchor_barriers,
    convex_constrained,
    loss_barrier,
    pairwise_barriers,
    project_l2_ball,
    proximal_step,
)
from strategies.hierarchical import Level, default_levels, fit_hierarchical
from strategies.soup import IncrementalSoup, SoupState, greedy_soup, load_ingredient, save_ingredient
from strategies.tangent import NotLinearizableError, TangentTask, linearize
from strategies.tasks import DigitsTask, NodeData, Task, TaskData, TextTask
from strategies.trainer import FitLog, NodeTrainer, Proximal, Schedule, TrainState

__all__ = [
    "ATTACKS",
    "BarrierReport",
    "Byzantine",
    "DigitsTask",
    "FitLog",
    "IncrementalSoup",
    "Level",
    "NodeData",
    "NodeTrainer",
    "NotLinearizableError",
    "Proximal",
    "Schedule",
    "SoupState",
    "TangentTask",
    "Task",
    "TaskData",
    "TextTask",
    "TrainState",
    "anchor_barriers",
    "apply_attack",
    "attacks",
    "byzantine",
    "byzantine_fit",
    "convex_constrained",
    "convexity",
    "default_levels",
    "fit_hierarchical",
    "get_attack",
    "greedy_soup",
    "hierarchical",
    "linearize",
    "load_ingredient",
    "loss_barrier",
    "pairwise_barriers",
    "project_l2_ball",
    "proximal_step",
    "save_ingredient",
    "soup",
    "tangent",
    "tasks",
    "trainer",
]
