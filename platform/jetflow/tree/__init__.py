"""Draft trees: construction algorithms, ancestor masks, acceptance. Pure torch/numpy; no Ray/MLflow."""

from jetflow.tree.accept import Acceptance, accept_greedy, accept_sampled, walk
from jetflow.tree.build import TREE_BUILDERS, build_tree, register_tree
from jetflow.tree.draft_tree import DraftTree

__all__ = [
    "Acceptance", "DraftTree", "TREE_BUILDERS", "accept_greedy", "accept_sampled", "build_tree",
    "register_tree", "walk",
]
