"""Tree construction (METHOD §3.2) and acceptance (§3.4), stated as properties.

Inputs mirror what the decoder hands `build_tree`: D rows (depths 1..D) of the top-W draft
log-probs, each row sorted descending, with the W distinct token ids of that depth. The shape
invariants hold for every registered algorithm, with and without a `TreeContext`; the algorithms
that read one are specified further in test_tree_algorithms.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetflow.errors import InvalidSettingError
from jetflow.tree import (
    TREE_BUILDERS, AcceptanceProfile, DraftTree, PromptInfo, TreeContext, TreeSpec, accept_greedy, accept_sampled,
    build_tree, observe, walk,
)

VOCAB = 1000
ALGORITHMS = sorted(TREE_BUILDERS)
FAST = settings(max_examples=60, deadline=None)
SCORE_TOL = 1e-9


def build(algorithm: str, root: int, logp, tokens, budget: int, width: int | None = None, context=None,
          **params) -> DraftTree:
    """`build_tree` of the TreeSpec (algorithm, budget, width, params); width defaults to every token given."""
    spec = TreeSpec(algorithm, budget, width if width is not None else max(1, len(logp[0]) if logp else 1), params)
    return build_tree(spec, root, logp, tokens, context)


# ---------------------------------------------------------------------------------------------
# strategies


@st.composite
def draft_rows(draw, max_depth: int = 15, max_width: int = 8):
    """(logp, tokens): D rows of W log-probs (sorted descending, <= 0) and W distinct tokens."""
    d = draw(st.integers(1, max_depth))
    w = draw(st.integers(1, max_width))
    if draw(st.booleans()):
        # as the decoder does it: log-softmax of a draft head's logits, then top-W per depth
        v = draw(st.integers(w, 48))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        scale = draw(st.sampled_from([0.1, 1.0, 5.0, 20.0]))
        logits = torch.randn(d, v, generator=gen) * scale
        top = torch.topk(torch.log_softmax(logits, dim=-1), w, dim=-1)
        return top.values.tolist(), top.indices.tolist()
    # hand-rolled rows: arbitrary sorted non-positive floats (ties and 0.0 included)
    logp = [sorted(draw(st.lists(st.floats(-30.0, 0.0), min_size=w, max_size=w)), reverse=True) for _ in range(d)]
    tokens = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=w, max_size=w, unique=True)) for _ in range(d)]
    return logp, tokens


budgets = st.integers(1, 300)
roots = st.integers(0, VOCAB - 1)
margins = st.floats(0.0, 10.0)

# the values each algorithm parameter may take (TreeSpec accepts them all); every parameter has one
PARAM_VALUES = {
    "margin": margins,
    "beta": st.floats(-5.0, 5.0),
    "gap_mid": st.one_of(st.floats(-5.0, 20.0), st.just(1e9)),
    "threshold": st.floats(-0.1, 1.0),
    "gap_high": st.floats(0.0, 10.0),
    "gap_low": st.floats(0.0, 10.0),
    "gap_threshold": st.floats(0.0, 10.0),
    "force_baseline": st.sampled_from([0.0, 1.0]),
    "warmup": st.integers(0, 6).map(float),
    "epsilon": st.floats(0.0, 1.0),
    "branches": st.integers(0, 8).map(float),
    "gap": st.one_of(st.floats(0.0, 10.0), st.just(1e9)),
}


@st.composite
def algorithm_params(draw, algorithm: str) -> dict[str, float]:
    params = {name: draw(PARAM_VALUES[name]) for name in TREE_BUILDERS[algorithm].params}
    if "gap_high" in params and params["gap_high"] < params["gap_low"]:
        params["gap_high"], params["gap_low"] = params["gap_low"], params["gap_high"]
    return params


@st.composite
def tables(draw, max_depth: int = 16, max_width: int = 9):
    """A per-(depth, rank) acceptance table; some depths without data (empty rows)."""
    return tuple(tuple(draw(st.lists(st.floats(0.0, 1.0), max_size=max_width)))
                 for _ in range(draw(st.integers(0, max_depth))))


@st.composite
def contexts(draw, spec: TreeSpec, max_depth: int, max_width: int):
    """None, or a TreeContext with any of: a profile, a prompt, a request state fed a few synthetic rounds."""
    if draw(st.booleans()):
        return None
    profile = None
    if draw(st.booleans()):
        classes = {c: draw(tables()) for c in draw(st.lists(
            st.sampled_from(["decisive_task", "balanced_task", "uncertain_task"]), max_size=3, unique=True))}
        profile = AcceptanceProfile(draw(tables()), classes)
    prompt = draw(st.none() | st.builds(
        PromptInfo, task=st.none() | st.sampled_from(["math", "code", "chat", "gsm", "mtbench", "unheard-of"]),
        mode=st.none() | st.sampled_from(["reasoning", "cot", "chat"]),
        text=st.none() | st.sampled_from(["Let me think step by step.", "Write a poem.", "First, add 2."])))
    context = TreeContext.for_request(spec, profile=profile, prompt=prompt, seed=draw(st.integers(0, 99)))
    rnd = random.Random(draw(st.integers(0, 2**31 - 1)))
    for _ in range(draw(st.integers(0, 12))):  # earlier rounds: random drafts, a random target walk
        logp, tokens = draw(draft_rows(max_depth, max_width))
        tree = build_tree(spec, 0, logp, tokens, context)
        observe(context.state, tree, walk(tree, lambda node: rnd.choice(
            [tree.tokens[c] for c in children_of(tree, node)] + [-1])))
    return context


@dataclass
class Built:
    spec: TreeSpec
    logp: list[list[float]]
    tokens: list[list[int]]
    root: int
    tree: DraftTree

    @property
    def width(self) -> int:
        return min(self.spec.width, len(self.logp[0]))


@st.composite
def built_trees(draw, algorithms=ALGORITHMS, max_depth: int = 15, max_width: int = 8) -> Built:
    """A random registered builder with random parameters (and, for one that reads it, a random context)
    on random draft rows."""
    algorithm = draw(st.sampled_from(algorithms))
    logp, tokens = draw(draft_rows(max_depth, max_width))
    width = draw(st.none() | st.integers(1, 10))
    spec = TreeSpec(algorithm, draw(budgets), width if width is not None else len(logp[0]),
                    draw(algorithm_params(algorithm)))
    context = draw(contexts(spec, max_depth, max_width)) if TREE_BUILDERS[algorithm].context else None
    root = draw(roots)
    return Built(spec, logp, tokens, root, build_tree(spec, root, logp, tokens, context))


@st.composite
def hand_built_trees(draw, max_nodes: int = 40, vocab: int = 4):
    """Arbitrary trees over a tiny vocabulary, so duplicate sibling tokens are common."""
    tree = DraftTree.root_only(draw(st.integers(0, vocab - 1)))
    for i in range(1, draw(st.integers(1, max_nodes))):
        tree.add(draw(st.integers(0, vocab - 1)), draw(st.integers(0, i - 1)))
    return tree


# ---------------------------------------------------------------------------------------------
# reference helpers


def children_of(tree: DraftTree, node: int) -> list[int]:
    return [i for i in range(node + 1, tree.size) if tree.parents[i] == node]


def rank_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    """The node's identity in the full W-ary tree: the draft ranks chosen at depths 1..depth."""
    return tuple(tree.ranks[i] for i in tree.path_to(node)[1:])


def token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """The tree as a set of token paths (root excluded): how trees of two implementations are compared."""
    return {tuple(tree.tokens[i] for i in tree.path_to(n)[1:]) for n in range(tree.size)}


def path_score(logp, ranks: tuple[int, ...]) -> float:
    score = 0.0
    for depth, r in enumerate(ranks):  # left to right, as the tree accumulates it
        score += logp[depth][r]
    return score


def full_tree_size(depth: int, caps: list[int]) -> int:
    size, level = 1, 1
    for d in range(depth):
        level *= caps[d]
        size += level
    return size


def all_capped_scores(logp, caps: list[int]) -> dict[tuple[int, ...], float]:
    """Every node of the tree where each depth-d node has the top-caps[d] tokens as children."""
    out: dict[tuple[int, ...], float] = {(): 0.0}
    level = [()]
    for d in range(len(logp)):
        level = [p + (r,) for p in level for r in range(caps[d])]
        for p in level:
            out[p] = path_score(logp, p)
    return out


def top2gap_caps(logp, margin: float, width: int | None = None) -> list[int]:
    w = len(logp[0]) if width is None else min(width, len(logp[0]))
    return [max(1, sum(1 for r in range(w) if row[0] - row[r] <= margin)) for row in logp]


def paper_rule(root: int, logp, tokens, budget: int, caps: list[int], rows=None) -> DraftTree:
    """The paper's tree rule (METHOD §3.2, JetSpec's accum_logp heap) stated without a heap: while the tree
    has fewer than `budget` nodes, take the not-yet-expanded node of depth < D with the highest cumulative
    log-prob — ties: the one created first — and append its children, ranks 0 .. min(caps[d], budget - size)
    - 1 of the next depth, each scored parent + log-prob. Stop when nothing is left to expand. `rows(tree,
    node)`, when given, says which (log-probs, tokens) row a node's children come from (default: the row of
    their depth)."""
    tree = DraftTree.root_only(root)
    expanded: set[int] = set()
    while tree.size < budget:
        candidates = [i for i in range(tree.size) if i not in expanded and tree.depths[i] < len(logp)]
        if not candidates:
            break
        best = max(candidates, key=lambda i: (tree.scores[i], -i))
        expanded.add(best)
        d = tree.depths[best]
        lp, tok = rows(tree, best) if rows is not None else (logp[d], tokens[d])
        for r in range(min(caps[d], budget - tree.size)):
            tree.add(tok[r], best, tree.scores[best] + lp[r], r)
    return tree


def assert_same_tree(got: DraftTree, expected: DraftTree) -> None:
    """Node for node: tokens, parents, depths, ranks and scores, in the same order — and so the same token paths."""
    assert (got.tokens, got.parents, got.depths, got.ranks) == (
        expected.tokens, expected.parents, expected.depths, expected.ranks)
    assert got.scores == expected.scores
    assert token_paths(got) == token_paths(expected)


# ---------------------------------------------------------------------------------------------
# 1. every builder yields a well-formed tree


def test_every_algorithm_parameter_has_a_property_test_strategy():
    assert {p for a in TREE_BUILDERS.values() for p in a.params} <= set(PARAM_VALUES)


@FAST
@given(built_trees())
def test_every_builder_stays_within_budget_counting_the_root(case):
    assert 1 <= case.tree.size <= case.spec.budget


@FAST
@given(built_trees())
def test_node_zero_is_the_root_and_parents_precede_children(case):
    tree = case.tree
    assert (tree.tokens[0], tree.parents[0], tree.depths[0], tree.scores[0]) == (case.root, -1, 0, 0.0)
    assert all(0 <= tree.parents[i] < i for i in range(1, tree.size))


@FAST
@given(built_trees())
def test_depth_is_parent_depth_plus_one_and_at_most_D(case):
    tree = case.tree
    for i in range(1, tree.size):
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
        assert tree.depths[i] <= len(case.logp)
    assert tree.max_depth == max(tree.depths)


@FAST
@given(built_trees())
def test_each_node_carries_a_top_width_draft_token_of_its_depth(case):
    tree = case.tree
    for i in range(1, tree.size):
        depth, rank = tree.depths[i], tree.ranks[i]
        assert 0 <= rank < case.width
        assert tree.tokens[i] == case.tokens[depth - 1][rank]


@FAST
@given(built_trees())
def test_a_nodes_children_are_the_top_ranks_of_the_next_depth_and_never_share_a_token(case):
    """Children are drawn from their depth's top-W: ranks 0..c-1, each once, in rank order."""
    tree = case.tree
    for node in range(tree.size):
        kids = children_of(tree, node)
        assert [tree.ranks[c] for c in kids] == list(range(len(kids)))
        assert len({tree.tokens[c] for c in kids}) == len(kids)


@FAST
@given(built_trees())
def test_scores_are_the_cumulative_logprob_along_the_path(case):
    tree = case.tree
    for i in range(tree.size):
        assert tree.scores[i] == pytest.approx(path_score(case.logp, rank_path(tree, i)), abs=SCORE_TOL)
        assert tree.scores[i] <= 0.0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_budget_one_is_the_root_alone(algorithm):
    tree = build(algorithm, 7, [[-0.1, -2.0]], [[3, 4]], 1)
    assert (tree.tokens, tree.parents, tree.depths) == ([7], [-1], [0])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_names_its_source(algorithm):
    assert TREE_BUILDERS[algorithm].source in ("paper", "planned", "ours")
    assert TREE_BUILDERS[algorithm].build.__doc__


# ---------------------------------------------------------------------------------------------
# TreeSpec: the one tree setting, validated once


@given(budget=st.one_of(st.integers(max_value=0), st.integers(min_value=4097), st.floats(), st.booleans(),
                        st.text(max_size=3)))
@settings(max_examples=40, deadline=None)
def test_tree_spec_rejects_a_budget_outside_1_to_4096_with_the_one_message(budget):
    with pytest.raises(InvalidSettingError, match=r"budget must be an integer in 1\.\.4096 \(tree nodes per round"):
        TreeSpec(budget=budget)


@given(name=st.text(max_size=12).filter(lambda s: s not in TREE_BUILDERS))
@settings(max_examples=20, deadline=None)
def test_tree_spec_rejects_an_unknown_algorithm(name):
    with pytest.raises(InvalidSettingError, match="unknown tree algorithm"):
        TreeSpec(name)


def test_tree_spec_rejects_parameters_its_algorithm_does_not_take():
    with pytest.raises(InvalidSettingError, match="no parameter"):
        TreeSpec("accum_logp", params={"margin": 1.0})
    with pytest.raises(InvalidSettingError, match="finite number"):
        TreeSpec("top2gap", params={"margin": math.inf})


@pytest.mark.parametrize("algorithm,params,message", [
    ("task_router", {"gap_high": 0.5, "gap_low": 1.0}, "gap_high"),
    ("class_histogram", {"gap_low": 3.0}, "gap_high"),
    ("task_router", {"force_baseline": 0.5}, "switch: 0 or 1"),
    ("reasoning_router", {"force_baseline": 2}, "switch: 0 or 1"),
    ("template_bandit", {"epsilon": 1.5}, r"epsilon must be in 0\.\.1"),
    ("online_warmup", {"warmup": -1}, "warmup must be in"),
    ("online_warmup", {"warmup": 2.5}, "whole number of rounds"),
])
def test_tree_spec_rejects_parameter_values_outside_their_algorithms_rules(algorithm, params, message):
    with pytest.raises(InvalidSettingError, match=message):
        TreeSpec(algorithm, params=params)


@given(data=st.data(), algorithm=st.sampled_from(ALGORITHMS), budget=st.integers(1, 4096),
       width=st.integers(1, 1024), block=st.integers(2, 64))
@settings(max_examples=80, deadline=None)
def test_tree_spec_round_trips_through_json_and_its_key(data, algorithm, budget, width, block):
    spec = TreeSpec(algorithm, budget, width, data.draw(algorithm_params(algorithm)))
    assert TreeSpec.from_json(spec.to_json()) == spec
    assert TreeSpec.from_key(spec.key) == spec
    assert TreeSpec.from_options(f"{algorithm}" + "".join(f":{k}={v!r}" for k, v in spec.params), budget,
                                 width) == spec
    assert hash(TreeSpec.from_dict(spec.to_dict())) == hash(spec)
    capped = spec.capped(block)
    if spec.is_chain:
        assert capped.width == 1 and capped.budget == min(budget, block)  # a chain has at most B nodes
    else:
        assert capped == spec


def test_tree_spec_is_canonical_defaults_dropped_and_chains_width_one():
    assert TreeSpec("top2gap", params={"margin": 2.0}) == TreeSpec("top2gap")  # the default margin
    assert TreeSpec("top2gap", params={"margin": 2.0}).key == "top2gap-b8w7"
    assert TreeSpec("top2gap", params={"margin": 1.5}).key == "top2gap.margin1.5-b8w7"
    assert TreeSpec("top2gap_fanout", params={"gap_mid": 1e9}).key == "top2gap_fanout.gap_mid1000000000.0-b8w7"
    big = TreeSpec("top2gap", params={"margin": 1e20})  # MLflow metric keys take no "+"
    assert big.key == "top2gap.margin1e20-b8w7" and TreeSpec.from_key(big.key) == big
    two = TreeSpec("online_warmup", params={"warmup": 0, "threshold": 0.0})  # two parameters in one key
    assert two.key == "online_warmup.threshold0.0.warmup0.0-b8w7" and TreeSpec.from_key(two.key) == two
    assert TreeSpec("chain", 16, 7) == TreeSpec("chain", 16, 1)
    assert TreeSpec(budget=1).plain and not TreeSpec().plain
    assert TreeSpec.from_options("top2gap:margin=0.5", 32).params == (("margin", 0.5),)


# ---------------------------------------------------------------------------------------------
# 2. accum_logp is the paper's rule: the best open node takes all its top-W children at once


@FAST
@given(draft_rows(), budgets, roots)
def test_accum_logp_is_the_papers_rule_stated_by_brute_force(rows, budget, root):
    """W 1..8, depths 1..15, budgets 1..300, ties included (hand-rolled rows repeat log-probs)."""
    logp, tokens = rows
    expected = paper_rule(root, logp, tokens, budget, [len(logp[0])] * len(logp))
    assert_same_tree(build("accum_logp", root, logp, tokens, budget), expected)


@pytest.mark.parametrize("width", [4, 7])
def test_accum_logp_conforms_to_the_papers_rule_on_peaked_draft_logits(width):
    """The issue's conformance check, against the brute-force statement: random peaked logits, budgets 8-256,
    trees compared as sets of token paths (and node for node)."""
    gen = torch.Generator().manual_seed(width)
    for trial in range(40):
        logits = torch.randn(15, 512, generator=gen) * 4.0
        logits[:, trial % 7] += 6.0  # one strong token per depth: the spine is likely, the tail is not
        top = torch.topk(torch.log_softmax(logits, -1), width, dim=-1)
        logp, tokens = top.values.tolist(), top.indices.tolist()
        for budget in (8, 16, 32, 64, 128, 256):
            got = build("accum_logp", 3, logp, tokens, budget)
            assert token_paths(got) == token_paths(paper_rule(3, logp, tokens, budget, [width] * 15))
            assert got.size == budget


def test_accum_logp_adds_a_weak_sibling_with_its_parent_where_best_first_does_not():
    """Budget 4 over two depths of width 2: expanding the root adds both tokens (0.6 and 0.3), then the
    0.6 node adds its 0.54 child. best_first keeps the top-4 by score instead, as does accum_logp here;
    at budget 3 they differ: accum_logp spends the budget on the root's two children."""
    logp = [[math.log(0.6), math.log(0.3)], [math.log(0.9), math.log(0.05)]]
    tokens = [[1, 2], [3, 4]]
    paper = build("accum_logp", 0, logp, tokens, 4)
    assert (paper.tokens, paper.parents) == ([0, 1, 2, 3], [-1, 0, 0, 1])
    assert [math.exp(s) for s in paper.scores] == pytest.approx([1.0, 0.6, 0.3, 0.54])
    assert (build("accum_logp", 0, logp, tokens, 3).tokens, build("best_first", 0, logp, tokens, 3).tokens) == (
        [0, 1, 2], [0, 1, 3])  # best_first: 0.6 then 0.54 (1→3) beats the 0.3 sibling


def test_accum_logp_breaks_score_ties_in_favour_of_the_node_created_first():
    """Equal scores everywhere: the root's children are expanded in creation order, each taking both ranks."""
    logp = [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    tokens = [[1, 2], [3, 4], [5, 6]]
    tree = build("accum_logp", 0, logp, tokens, 7)
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.tokens == [0, 1, 2, 3, 4, 3, 4]


@FAST
@given(draft_rows(), budgets, roots, st.integers(1, 10))
def test_width_caps_fanout_as_if_rows_were_truncated(rows, budget, root, width):
    logp, tokens = rows
    for algorithm in ("accum_logp", "best_first"):
        capped = build(algorithm, root, logp, tokens, budget, width=width)
        truncated = build(algorithm, root, [r[:width] for r in logp], [t[:width] for t in tokens], budget)
        assert all(len(children_of(capped, i)) <= width for i in range(capped.size))
        assert_same_tree(capped, truncated)


# ---------------------------------------------------------------------------------------------
# 3. best_first (ours) is the exact top-`budget` set by cumulative log-prob


@FAST
@given(built_trees(algorithms=["best_first"]))
def test_best_first_keeps_the_highest_cumulative_logprob_nodes(case):
    """No node left out (whose parent is in the tree) beats the worst node kept."""
    logp, tree, w = case.logp, case.tree, case.width
    d = len(logp)
    assert tree.size == min(case.spec.budget, full_tree_size(d, [w] * d))
    kept = {rank_path(tree, i) for i in range(tree.size)}
    assert len(kept) == tree.size
    frontier = [
        path_score(logp, p + (r,))
        for p in kept
        if len(p) < d
        for r in range(w)
        if p + (r,) not in kept
    ]
    if frontier:
        assert min(tree.scores) >= max(frontier) - SCORE_TOL


@FAST
@given(built_trees(algorithms=["best_first"], max_depth=5, max_width=4))
def test_best_first_matches_an_exhaustive_ranking_of_the_full_tree(case):
    """On trees small enough to enumerate: the kept scores are the top-n scores of the W-ary tree."""
    logp, tree, w = case.logp, case.tree, case.width
    d = len(logp)
    every = sorted(all_capped_scores(logp, [w] * d).values(), reverse=True)
    n = min(case.spec.budget, len(every))
    assert tree.size == n
    assert sorted(tree.scores, reverse=True) == pytest.approx(every[:n], abs=SCORE_TOL)


@FAST
@given(draft_rows(), budgets, roots)
def test_best_first_never_holds_less_head_probability_than_accum_logp(rows, budget, root):
    """Under the head's own probabilities the exact top-B subtree is at least as good: the summed path
    probability (the expected accepted drafts if the head were the target) of best_first >= accum_logp's."""
    logp, tokens = rows
    mass = {a: sum(math.exp(s) for s in build(a, root, logp, tokens, budget).scores[1:])
            for a in ("accum_logp", "best_first")}
    assert mass["best_first"] >= mass["accum_logp"] - 1e-9


def test_best_first_on_a_hand_checked_example():
    """A hand-checked best_first tree: budget 4 over two depths of width 2."""
    logp = [[math.log(0.6), math.log(0.3)], [math.log(0.9), math.log(0.05)]]
    tokens = [[1, 2], [3, 4]]
    tree = build("best_first", 0, logp, tokens, 4)
    # 0.6 (tok 1), 0.54 (1→3), 0.3 (tok 2) beat 0.27 (2→3) and 0.03 (1→4)
    assert tree.tokens == [0, 1, 3, 2]
    assert tree.parents == [-1, 0, 1, 0]
    assert [math.exp(s) for s in tree.scores] == pytest.approx([1.0, 0.6, 0.54, 0.3])


# ---------------------------------------------------------------------------------------------
# 4. chain is the argmax spine


@FAST
@given(draft_rows(), budgets, roots, st.integers(1, 10))
def test_chain_is_the_rank0_path_of_length_min_budget_D_plus_1(rows, budget, root, width):
    logp, tokens = rows
    tree = build("chain", root, logp, tokens, budget, width=width)  # width must not widen it
    n = min(budget, len(logp) + 1)
    assert tree.size == n
    assert tree.parents == [-1] + list(range(n - 1))
    assert tree.depths == list(range(n))
    assert tree.ranks == [0] * n
    assert tree.tokens == [root] + [tokens[d][0] for d in range(n - 1)]
    assert tree.max_depth == tree.size - 1  # what the decoder tests to use the plain causal mask
    assert_same_tree(tree, build("accum_logp", root, logp, tokens, budget, width=1))  # the paper's W = 1


# ---------------------------------------------------------------------------------------------
# 5. top2gap (ours) caps each depth's fanout by the ranks within `margin` of the top-1


@FAST
@given(draft_rows(), budgets, roots, margins, st.one_of(st.none(), st.integers(1, 10)))
def test_top2gap_fanout_never_exceeds_the_ranks_within_margin_of_top1(rows, budget, root, margin, width):
    logp, tokens = rows
    tree = build("top2gap", root, logp, tokens, budget, margin=margin, width=width)
    w = len(logp[0]) if width is None else min(width, len(logp[0]))
    for node in range(tree.size):
        kids = children_of(tree, node)
        if not kids:
            continue
        row = logp[tree.depths[node]]  # the children's depth is depths[node] + 1 → row index depths[node]
        allowed = max(1, sum(1 for r in range(w) if row[0] - row[r] <= margin))
        assert len(kids) <= allowed
        assert all(tree.ranks[c] < allowed for c in kids)


@FAST
@given(draft_rows(max_depth=5, max_width=4), budgets, roots, margins)
def test_top2gap_keeps_the_highest_scoring_nodes_within_its_caps(rows, budget, root, margin):
    logp, tokens = rows
    tree = build("top2gap", root, logp, tokens, budget, margin=margin)
    every = sorted(all_capped_scores(logp, top2gap_caps(logp, margin)).values(), reverse=True)
    n = min(budget, len(every))
    assert tree.size == n
    assert sorted(tree.scores, reverse=True) == pytest.approx(every[:n], abs=SCORE_TOL)


def test_top2gap_gives_a_confident_depth_fanout_one_and_an_uncertain_one_more():
    logp = [[-0.01, -5.0, -6.0], [-1.0, -1.1, -1.5]]  # depth 1: gap 4.99 > 2; depth 2: all within 2
    tokens = [[10, 11, 12], [20, 21, 22]]
    tree = build("top2gap", 0, logp, tokens, 100, margin=2.0)
    assert tree.tokens == [0, 10, 20, 21, 22]
    assert tree.parents == [-1, 0, 1, 1, 1]


# ---------------------------------------------------------------------------------------------
# 6. ancestor mask


def _check_ancestor_mask(tree: DraftTree) -> None:
    mask = tree.ancestor_mask()
    assert mask.shape == (tree.size, tree.size) and mask.dtype == bool
    for i in range(tree.size):
        assert set(np.flatnonzero(mask[i]).tolist()) == set(tree.path_to(i))
    assert mask.diagonal().all()
    assert mask[:, 0].all()  # the root is everyone's ancestor
    assert not np.triu(mask, k=1).any()  # lower-triangular: ancestors precede


@FAST
@given(built_trees())
def test_ancestor_mask_row_i_is_exactly_the_path_to_i(case):
    _check_ancestor_mask(case.tree)


@FAST
@given(hand_built_trees())
def test_ancestor_mask_row_i_is_exactly_the_path_to_i_for_any_shape(tree):
    _check_ancestor_mask(tree)


@FAST
@given(hand_built_trees())
def test_path_to_runs_from_the_root_through_parents(tree):
    for i in range(tree.size):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i and len(path) == tree.depths[i] + 1
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))


# ---------------------------------------------------------------------------------------------
# 7. acceptance


@st.composite
def target_choices(draw, tree: DraftTree):
    """A target 'argmax' per node: often a child's token (so the walk goes on), else any token."""
    rnd = draw(st.randoms(use_true_random=False))
    follow = draw(st.floats(0.0, 1.0))
    target = {}
    for node in range(tree.size):
        kid_tokens = sorted({tree.tokens[c] for c in children_of(tree, node)})
        if kid_tokens and rnd.random() < follow:
            target[node] = rnd.choice(kid_tokens)
        else:
            target[node] = rnd.randrange(VOCAB + 10)
    return target


def _check_acceptance(tree: DraftTree, target: dict[int, int]) -> None:
    consulted: list[int] = []

    def argmax_at(node: int) -> int:
        consulted.append(node)
        return target[node]

    acc = accept_greedy(tree, argmax_at)
    path = acc.path
    assert path[0] == 0
    assert acc.accepted == len(path) - 1
    for prev, nxt in zip(path, path[1:]):
        assert tree.parents[nxt] == prev  # a root path
        assert tree.tokens[nxt] == target[prev]  # accepted only what the target chose
        # duplicate sibling tokens count once: the first child carrying the token
        assert nxt == min(c for c in children_of(tree, prev) if tree.tokens[c] == target[prev])
    last = path[-1]
    assert acc.bonus == target[last]
    assert acc.bonus not in {tree.tokens[c] for c in children_of(tree, last)}  # the walk stopped only when forced
    assert consulted == path  # the target is consulted once per accepted node, the last giving the bonus
    # every acceptance entry point is the same walk
    assert walk(tree, target.__getitem__) == acc
    assert accept_sampled(tree, target.__getitem__) == acc


@FAST
@given(st.data())
def test_greedy_acceptance_follows_the_targets_choices_from_the_root(data):
    tree = data.draw(built_trees()).tree
    _check_acceptance(tree, data.draw(target_choices(tree)))


@FAST
@given(st.data())
def test_acceptance_follows_the_first_child_among_duplicate_sibling_tokens(data):
    tree = data.draw(hand_built_trees())
    _check_acceptance(tree, data.draw(target_choices(tree)))


def test_duplicate_sibling_tokens_count_once_and_the_first_child_wins():
    tree = DraftTree.root_only(5)
    a = tree.add(7, 0)
    b = tree.add(7, 0)  # same token as a: never reached
    tree.add(9, b)
    d = tree.add(9, a)
    acc = accept_greedy(tree, {0: 7, a: 9, d: 3}.__getitem__)
    assert (acc.path, acc.bonus, acc.accepted) == ([0, a, d], 3, 2)


def test_a_root_only_tree_accepts_nothing_and_commits_the_bonus():
    acc = accept_greedy(DraftTree.root_only(4), lambda node: 11)
    assert (acc.path, acc.bonus, acc.accepted) == ([0], 11, 0)


@FAST
@given(draft_rows(), budgets, roots, st.data())
def test_a_chain_accepts_the_longest_prefix_the_target_agrees_with(rows, budget, root, data):
    logp, tokens = rows
    tree = build("chain", root, logp, tokens, budget)
    agree = data.draw(st.integers(0, tree.size - 1))
    # the target agrees with the spine up to `agree`, then picks a token that is not the next one
    target = {i: tree.tokens[i + 1] for i in range(agree)}
    target[agree] = -1
    acc = accept_greedy(tree, target.__getitem__)
    assert acc.accepted == agree
    assert acc.path == list(range(agree + 1))
    assert acc.bonus == -1


def test_algorithm_option_is_what_parse_algorithm_reads_back():
    from jetflow.tree.spec import parse_algorithm

    spec = TreeSpec.from_options("top2gap:margin=1.5", 16, 7)
    assert spec.algorithm_option == "top2gap:margin=1.5"
    name, params = parse_algorithm(spec.algorithm_option)
    assert TreeSpec(name, 16, 7, params) == spec
    assert TreeSpec.from_options("accum_logp", 8, 7).algorithm_option == "accum_logp"
