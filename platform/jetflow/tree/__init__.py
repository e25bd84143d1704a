"""Draft trees: the tree setting (`TreeSpec`), construction algorithms (a registry: the paper's, the ones it
planned, ours), what they may read beyond the draft (`TreeContext`), ancestor masks, acceptance.
Pure torch/numpy; imports nothing from the rest of JetFlow but `errors`."""

from jetflow.tree.accept import Acceptance, accept_greedy, accept_sampled, walk, walker
from jetflow.tree.build import TREE_BUILDERS, TreeAlgorithm, build_tree, register_tree
from jetflow.tree.context import PromptInfo, Redraft, TreeContext, TreeState, new_tree_state, observe
from jetflow.tree.draft_tree import DraftTree
from jetflow.tree.profile import PROFILE_FILE, AcceptanceProfile
from jetflow.tree.spec import (
    DEFAULT_BUDGET, MAX_BUDGET, TreeSpec, check_budget, parse_algorithm, setting_key, tree_grid,
)
from jetflow.tree.templates import ShapeTemplates
from jetflow.tree import online, refresh, routers  # noqa: F401  (registers their algorithms)

__all__ = [
    "Acceptance", "AcceptanceProfile", "DEFAULT_BUDGET", "DraftTree", "MAX_BUDGET", "PROFILE_FILE", "PromptInfo", "Redraft",
    "ShapeTemplates", "TREE_BUILDERS", "TreeAlgorithm", "TreeContext", "TreeSpec", "TreeState", "accept_greedy",
    "accept_sampled", "build_tree", "check_budget", "new_tree_state", "observe", "parse_algorithm",
    "register_tree", "setting_key", "tree_grid", "walk", "walker",
]
