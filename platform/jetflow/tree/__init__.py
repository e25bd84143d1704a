"""Draft trees: the tree setting (`TreeSpec`), construction algorithms, ancestor masks, acceptance.
Pure torch/numpy; imports nothing from the rest of JetFlow but `errors`."""

from jetflow.tree.accept import Acceptance, accept_greedy, accept_sampled, walk, walker
from jetflow.tree.build import TREE_BUILDERS, TreeAlgorithm, build_tree, register_tree
from jetflow.tree.draft_tree import DraftTree
from jetflow.tree.spec import (
    DEFAULT_BUDGET, MAX_BUDGET, TreeSpec, check_budget, parse_algorithm, setting_key, tree_grid,
)

__all__ = [
    "Acceptance", "DEFAULT_BUDGET", "DraftTree", "MAX_BUDGET", "TREE_BUILDERS", "TreeAlgorithm", "TreeSpec",
    "accept_greedy", "accept_sampled", "build_tree", "check_budget", "parse_algorithm", "register_tree",
    "setting_key", "tree_grid", "walk", "walker",
]
