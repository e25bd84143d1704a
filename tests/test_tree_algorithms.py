"""The tree algorithms beyond the base builders — the paper's fanout-cap shapers (top2gap_fanout,
depth_rank_histogram, task_router, reasoning_router, class_histogram), the two it planned (online_warmup,
template_bandit) — and what they read: `TreeContext` (profile, prompt, templates, online state).

Each shaper is specified as "the paper's heap (`paper_rule`, the brute-force statement in test_tree.py) under
the caps its rule gives", plus its identity setting (= accum_logp); the online ones also by feeding them
synthetic acceptances. The slow tests decode with every registered algorithm on the real bundled model, with
a context and the per-round `observe` hook wired the way the decoder and the engine call them.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from jetflow.errors import InvalidSettingError
from jetflow.tree import (
    PROFILE_FILE, TREE_BUILDERS, Acceptance, AcceptanceProfile, DraftTree, PromptInfo, ShapeTemplates, TreeContext,
    TreeSpec, build_tree, new_tree_state, observe, walk,
)
from jetflow.tree.online import BanditState, WarmupState
from jetflow.tree.profile import conditional_table, histogram_caps, main as profile_main, support_caps
from jetflow.tree.templates import expand_template
from tests.test_tree import (
    ALGORITHMS, FAST, algorithm_params, assert_same_tree, budgets, build, children_of, contexts, draft_rows,
    paper_rule, roots, tables,
)

README = Path(__file__).resolve().parents[1] / "README.md"
SHAPES = ShapeTemplates.shipped()


def full(logp, width: int | None = None) -> list[int]:
    k = len(logp[0]) if width is None else min(width, len(logp[0]))
    return [k] * len(logp)


def rows_with_gaps(gaps: list[float], width: int = 4) -> tuple[list[list[float]], list[list[int]]]:
    """Draft rows whose top-1/top-2 gap at each depth is `gaps[d]` (later ranks 0.5 nats apart)."""
    logp = [[-0.1] + [-0.1 - g - 0.5 * r for r in range(width - 1)] for g in gaps]
    tokens = [[100 * (d + 1) + r for r in range(width)] for d in range(len(gaps))]
    return logp, tokens


def spine_target(tree: DraftTree):
    """A target that always takes the rank-0 child: the spine is accepted as deep as the tree drafts it."""
    return lambda node: next((tree.tokens[c] for c in children_of(tree, node) if tree.ranks[c] == 0), -1)


# ---------------------------------------------------------------------------------------------
# top2gap_fanout (paper): sigmoid caps from the top-2 gap, on the paper's heap


def restated_sigmoid_caps(logp, k: int, beta: float, gap_mid: float) -> list[int]:
    """cap_d = max(1, round(K / (1 + e^{beta (g_d - gap_mid)}))): K · sigmoid(-beta (g_d - gap_mid)), as the
    paper's top2gap_fanout writes it; a chain when K < 2."""
    if k < 2:
        return [1] * len(logp)
    caps = []
    for row in logp:
        try:
            s = 1.0 / (1.0 + math.exp(beta * (row[0] - row[1] - gap_mid)))
        except OverflowError:
            s = 0.0
        assume(abs(k * s - math.floor(k * s) - 0.5) > 1e-6)  # two float routes may round a near-half apart
        caps.append(max(1, round(k * s)))
    return caps


@FAST
@given(draft_rows(), budgets, roots, st.floats(-5.0, 5.0), st.floats(-5.0, 20.0), st.integers(1, 10))
def test_top2gap_fanout_is_the_papers_heap_under_sigmoid_gap_caps(rows, budget, root, beta, gap_mid, width):
    logp, tokens = rows
    caps = restated_sigmoid_caps(logp, min(width, len(logp[0])), beta, gap_mid)
    tree = build("top2gap_fanout", root, logp, tokens, budget, width=width, beta=beta, gap_mid=gap_mid)
    assert_same_tree(tree, paper_rule(root, logp, tokens, budget, caps))


@FAST
@given(draft_rows(), budgets, roots, st.floats(0.1, 5.0))
def test_top2gap_fanout_recovers_accum_logp_at_a_huge_gap_mid(rows, budget, root, beta):
    logp, tokens = rows
    assert_same_tree(build("top2gap_fanout", root, logp, tokens, budget, beta=beta, gap_mid=1e9),
                     build("accum_logp", root, logp, tokens, budget))


def test_top2gap_fanout_gives_a_decisive_depth_one_child_and_a_split_one_most_of_the_width():
    logp, tokens = rows_with_gaps([5.0, 0.05], width=7)
    tree = build("top2gap_fanout", 0, logp, tokens, 100)  # beta 1, gap_mid 1
    # depth 1: 7·σ(-4) = 0.12 → 1; depth 2: 7·σ(0.95) = 5.05 → 5
    assert [len(children_of(tree, n)) for n in range(tree.size)] == [1, 5, 0, 0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# depth_rank_histogram (paper): caps from the head's measured per-(depth, rank) acceptance


def restated_histogram_caps(rows, threshold: float, k: int, depths: int) -> list[int]:
    """How many ranks (of the first k) the profile says clear the threshold, at least 1; no data: k."""
    return [k if threshold <= 0 or d >= len(rows) or not rows[d]
            else min(k, max(1, len([a for a in rows[d][:k] if a >= threshold]))) for d in range(depths)]


@FAST
@given(draft_rows(), budgets, roots, tables(), st.floats(-0.1, 1.0))
def test_depth_rank_histogram_is_the_papers_heap_under_profile_caps(rows, budget, root, table, threshold):
    logp, tokens = rows
    context = TreeContext(profile=AcceptanceProfile(table))
    tree = build("depth_rank_histogram", root, logp, tokens, budget, context=context, threshold=threshold)
    caps = restated_histogram_caps(table, threshold, len(logp[0]), len(logp))
    assert_same_tree(tree, paper_rule(root, logp, tokens, budget, caps))


@FAST
@given(draft_rows(), budgets, roots, tables())
def test_depth_rank_histogram_recovers_accum_logp_without_a_profile_or_a_positive_threshold(rows, budget, root, table):
    logp, tokens = rows
    paper = build("accum_logp", root, logp, tokens, budget)
    assert_same_tree(build("depth_rank_histogram", root, logp, tokens, budget), paper)
    assert_same_tree(build("depth_rank_histogram", root, logp, tokens, budget, context=TreeContext()), paper)
    assert_same_tree(build("depth_rank_histogram", root, logp, tokens, budget, threshold=0.0,
                           context=TreeContext(profile=AcceptanceProfile(table))), paper)


def test_depth_rank_histogram_drafts_only_the_ranks_the_profile_says_get_accepted():
    logp, tokens = rows_with_gaps([0.1, 0.1, 0.1], width=4)
    profile = AcceptanceProfile(((0.7, 0.2, 0.01, 0.0), (0.9, 0.001), ()))  # depth 3: no data → full width
    tree = build("depth_rank_histogram", 0, logp, tokens, 200, context=TreeContext(profile=profile))
    per_depth = {d: {len(children_of(tree, n)) for n in range(tree.size) if tree.depths[n] == d} for d in range(3)}
    assert per_depth == {0: {2}, 1: {1}, 2: {4}}


def test_histogram_caps_count_the_ranks_above_threshold_and_support_caps_take_the_deepest_accepted():
    rows = ((0.5, 0.0, 0.3), (0.0, 0.0, 0.0), ())
    assert histogram_caps(rows, 0.1, 3, 4) == [2, 1, 3, 3]   # a count (not rank 2 + 1); no data: full width
    assert support_caps(rows, 3, 4) == [3, 1, 1, 1]          # deepest rank with any acceptance; no data: 1


# ---------------------------------------------------------------------------------------------
# the routers (paper): a class per prompt, a template per class (config), the paper's heap


@pytest.mark.parametrize("algorithm", ["task_router", "reasoning_router", "class_histogram"])
@FAST
@given(data=st.data(), rows=draft_rows(), budget=budgets, root=roots)
def test_a_router_recovers_accum_logp_at_force_baseline(algorithm, data, rows, budget, root):
    logp, tokens = rows
    spec = TreeSpec(algorithm, budget, len(logp[0]), {**data.draw(algorithm_params(algorithm)), "force_baseline": 1})
    context = data.draw(contexts(spec, 15, 8))
    assert_same_tree(build_tree(spec, root, logp, tokens, context), build("accum_logp", root, logp, tokens, budget))


@pytest.mark.parametrize("task,template", [
    ("code", [1]), ("math", [1]), ("gsm", [1]), ("chat", [7, 7, 1]), ("mtbench", [7, 7, 1]), ("unheard-of", [3, 2, 1])])
def test_task_router_drafts_the_template_of_the_labelled_class(task, template):
    logp, tokens = rows_with_gaps([0.1] * 5, width=7)
    context = TreeContext(prompt=PromptInfo(task=task))
    tree = build("task_router", 0, logp, tokens, 64, context=context)
    assert_same_tree(tree, paper_rule(0, logp, tokens, 64, expand_template(template, 5, 7)))
    assert_same_tree(build("class_histogram", 0, logp, tokens, 64, context=context), tree)  # no class table


@pytest.mark.parametrize("gap,template", [(3.0, [1]), (0.5, [7, 7, 1]), (1.5, [3, 2, 1])])
def test_task_router_without_a_label_classifies_by_the_drafts_mean_top2_gap(gap, template):
    logp, tokens = rows_with_gaps([gap] * 4, width=7)
    tree = build("task_router", 0, logp, tokens, 64)  # gap_high 2, gap_low 1
    assert_same_tree(tree, paper_rule(0, logp, tokens, 64, expand_template(template, 4, 7)))


@pytest.mark.parametrize("prompt,reasoning", [
    (PromptInfo(mode="reasoning"), True), (PromptInfo(mode="COT"), True), (PromptInfo(task="math"), True),
    (PromptInfo(task="humaneval"), True), (PromptInfo(text="Solve it. Let me think step by step."), True),
    (PromptInfo(text="<think>\n"), True), (PromptInfo(task="chat", text="Write a poem about trees."), False),
    (None, False)])
def test_reasoning_router_drafts_a_chain_for_reasoning_prompts_and_the_open_ended_template_otherwise(prompt, reasoning):
    logp, tokens = rows_with_gaps([0.2] * 4, width=7)  # a split draft: the fingerprint says "not reasoning"
    tree = build("reasoning_router", 0, logp, tokens, 64, context=TreeContext(prompt=prompt))
    caps = [1] * 4 if reasoning else expand_template(SHAPES.open_ended, 4, 7)
    assert_same_tree(tree, paper_rule(0, logp, tokens, 64, caps))


def test_reasoning_router_reads_a_decisive_draft_as_reasoning_without_a_prompt():
    logp, tokens = rows_with_gaps([2.0] * 4, width=7)  # mean gap 2 > gap_threshold 1.5
    assert build("reasoning_router", 0, logp, tokens, 64).max_depth == 4
    assert build("reasoning_router", 0, logp, tokens, 64).size == 5


def test_class_histogram_caps_from_its_class_table_in_the_profile():
    logp, tokens = rows_with_gaps([0.1] * 3, width=5)
    profile = AcceptanceProfile((), {"decisive_task": ((0.6, 0.0, 0.01, 0.0), (0.9,))})
    tree = build("class_histogram", 0, logp, tokens, 100,
                 context=TreeContext(profile=profile, prompt=PromptInfo(task="code")))
    assert_same_tree(tree, paper_rule(0, logp, tokens, 100, [3, 1, 1]))


def test_templates_are_config_a_file_replaces_them(tmp_path):
    custom = SHAPES.to_dict()
    custom["classes"]["decisive_task"] = [2, 2]
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(custom))
    logp, tokens = rows_with_gaps([0.1] * 3, width=4)
    context = TreeContext(prompt=PromptInfo(task="code"), templates=ShapeTemplates.load(path))
    assert_same_tree(build("task_router", 0, logp, tokens, 100, context=context),
                     paper_rule(0, logp, tokens, 100, [2, 2, 1]))


def test_the_shipped_templates_are_the_papers_classes():
    assert {k: list(v) for k, v in SHAPES.classes.items()} == {
        "decisive_task": [1], "balanced_task": [3, 2, 1], "uncertain_task": [7, 7, 1]}
    assert SHAPES.default_class == "balanced_task"
    assert ShapeTemplates.from_dict(SHAPES.to_dict()).to_dict() == SHAPES.to_dict()


@pytest.mark.parametrize("change,message", [
    ({"classes": {"a": [0]}}, "fanout caps >= 1"),
    ({"default_class": "nope"}, "default_class"),
    ({"task_aliases": {"x": "nope"}}, "unknown classes"),
    ({"colour": "blue"}, "unknown tree template fields"),
    ({"bandit_arms": {"a": []}}, "non-empty list"),
])
def test_a_malformed_template_file_is_an_invalid_setting_naming_the_field(change, message):
    with pytest.raises(InvalidSettingError, match=message):
        ShapeTemplates.from_dict({**SHAPES.to_dict(), **change})


def test_a_missing_template_file_says_where_it_looked(tmp_path):
    with pytest.raises(InvalidSettingError, match="no tree template file"):
        ShapeTemplates.load(tmp_path / "absent.json")


# ---------------------------------------------------------------------------------------------
# the profile: from an evaluation report, stored as JSON beside the head


def flat(table) -> list[float]:
    """A table's entries row by row, with the row lengths, for pytest.approx."""
    return [len(row) for row in table] + [x for row in table for x in row]


def _report() -> dict:
    """Round fractions as `metrics.per_rank_acceptance` writes them into a report's `rank_acceptance`."""
    wide = {"1,0": 0.6, "1,1": 0.2, "2,0": 0.4, "2,2": 0.08}     # 80% reach depth 1, 48% depth 2
    return {"created_at": "2026-01-01T00:00:00+00:00", "head": {"uri": "models:/h/3"},
            "rank_acceptance": {
                "humaneval/causal/accum_logp-b64w7-t0": wide,
                "mtbench/causal/accum_logp-b64w7-t0": {"1,0": 0.4},
                "humaneval/causal/accum_logp-b8w7-t0": {"1,0": 0.1},          # narrower: not chosen
                "humaneval/causal/accum_logp-b64w7-t0.7": {"1,0": 0.9},       # sampled: not chosen
                "humaneval/bidirectional/accum_logp-b64w7-t0": {"1,0": 0.9},  # the other head
                "humaneval/causal/top2gap.margin1.5-b256w7-t0": {"1,0": 0.9}}}


def test_a_profile_from_a_report_conditions_rank_acceptance_on_reaching_the_parent_depth():
    assert flat(conditional_table({(1, 0): 0.6, (1, 1): 0.2, (2, 0): 0.4, (2, 2): 0.08})) == pytest.approx(
        flat(((0.6, 0.2, 0.0), (0.5, 0.0, 0.1))))
    profile = AcceptanceProfile.from_report(_report())
    assert profile.meta["setting"] == "accum_logp-b64w7" and profile.meta["sets"] == ["humaneval", "mtbench"]
    # sets weigh equally: depth 1 (0.5, 0.1); depth 2 conditioned on reaching depth 1 (0.6)
    assert flat(profile.depth_rank) == pytest.approx(flat(((0.5, 0.1, 0.0), (0.2 / 0.6, 0.0, 0.04 / 0.6))))
    assert set(profile.classes) == {"decisive_task", "uncertain_task"}  # humaneval → code, mtbench → chat
    assert flat(profile.classes["decisive_task"]) == pytest.approx(flat(((0.6, 0.2, 0.0), (0.5, 0.0, 0.1))))
    assert AcceptanceProfile.from_report(_report(), setting="top2gap.margin1.5-b256w7").depth_rank == ((0.9,),)


def test_a_profile_from_a_report_without_greedy_head_rows_says_what_to_measure():
    with pytest.raises(InvalidSettingError, match="temperature 0"):
        AcceptanceProfile.from_report({"rank_acceptance": {}})
    with pytest.raises(InvalidSettingError, match="measured no causal setting"):
        AcceptanceProfile.from_report(_report(), setting="chain-b16w1")


def test_a_profile_round_trips_through_json_in_the_papers_schema(tmp_path):
    profile = AcceptanceProfile.from_report(_report())
    path = profile.save(tmp_path / "head" / PROFILE_FILE)
    assert set(json.loads(path.read_text())) == {"depth_rank_accept", "per_class_histograms", "meta"}
    loaded = AcceptanceProfile.load(tmp_path / "head")  # a head folder: its tree_profile.json
    assert (loaded.depth_rank, dict(loaded.classes), dict(loaded.meta)) == (
        profile.depth_rank, dict(profile.classes), dict(profile.meta))
    with pytest.raises(InvalidSettingError, match="no tree profile"):
        AcceptanceProfile.load(tmp_path / "elsewhere.json")
    with pytest.raises(InvalidSettingError, match="depth_rank_accept"):
        AcceptanceProfile.from_dict({"meta": {}})


def test_the_profile_command_writes_a_heads_profile_from_a_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report()))
    (tmp_path / "head").mkdir()
    assert profile_main([str(report), "--out", str(tmp_path / "head")]) == 0
    assert AcceptanceProfile.load(tmp_path / "head" / PROFILE_FILE).meta["setting"] == "accum_logp-b64w7"
    assert "depth  1" in capsys.readouterr().out
    assert profile_main([str(report), "--method", "nobody", "--out", str(tmp_path / "p.json")]) == 2


# ---------------------------------------------------------------------------------------------
# the context and the feedback hook


def test_only_the_online_algorithms_keep_a_request_state():
    stateful = {a for a in ALGORITHMS if new_tree_state(TreeSpec(a)) is not None}
    assert stateful == {"online_warmup", "template_bandit"}
    assert isinstance(new_tree_state(TreeSpec("online_warmup", params={"warmup": 3})), WarmupState)
    assert new_tree_state(TreeSpec("online_warmup", params={"warmup": 3})).warmup == 3
    observe(None, DraftTree.root_only(1), Acceptance([0], 2))  # no state: nothing to feed


@FAST
@given(data=st.data(), rows=draft_rows(), budget=budgets, root=roots)
def test_an_algorithm_that_reads_no_context_ignores_one(data, rows, budget, root):
    logp, tokens = rows
    algorithm = data.draw(st.sampled_from([a for a in ALGORITHMS if not TREE_BUILDERS[a].context]))
    spec = TreeSpec(algorithm, budget, len(logp[0]), data.draw(algorithm_params(algorithm)))
    context = data.draw(contexts(spec, 15, 8))
    assert_same_tree(build_tree(spec, root, logp, tokens, context), build_tree(spec, root, logp, tokens))


@pytest.mark.parametrize("algorithm", ["online_warmup", "template_bandit"])
@FAST
@given(data=st.data(), rows=draft_rows(), budget=budgets, root=roots)
def test_an_online_algorithm_drafts_accum_logp_until_it_gets_feedback(algorithm, data, rows, budget, root):
    logp, tokens = rows
    spec = TreeSpec(algorithm, budget, len(logp[0]), data.draw(algorithm_params(algorithm)))
    paper = build("accum_logp", root, logp, tokens, budget)
    assert_same_tree(build_tree(spec, root, logp, tokens), paper)                       # no context
    assert_same_tree(build_tree(spec, root, logp, tokens, TreeContext()), paper)        # no state
    fresh = TreeContext.for_request(spec, seed=data.draw(st.integers(0, 99)))
    assert_same_tree(build_tree(spec, root, logp, tokens, fresh), paper)                # no feedback yet
    other = TreeContext(state=new_tree_state(TreeSpec("template_bandit" if algorithm == "online_warmup"
                                                      else "online_warmup")))
    assert_same_tree(build_tree(spec, root, logp, tokens, other), paper)                # another algorithm's


# ---------------------------------------------------------------------------------------------
# online_warmup (planned): the request's own acceptance table after `warmup` rounds


def _rounds(spec: TreeSpec, context: TreeContext, n: int, target, seed: int = 0, depth: int = 6, width: int = 4):
    """n verify rounds on random peaked drafts: build with the context, walk with `target(tree)`, observe."""
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(n):
        top = torch.topk(torch.log_softmax(torch.randn(depth, 50, generator=gen) * 3, -1), width, -1)
        tree = build_tree(spec, 0, top.values.tolist(), top.indices.tolist(), context)
        observe(context.state, tree, walk(tree, target(tree)))
        trees.append(tree)
    return trees


def test_online_warmup_learns_a_chain_when_the_target_only_ever_takes_rank_0():
    spec = TreeSpec("online_warmup", 48, 4, {"warmup": 5})
    context = TreeContext.for_request(spec)
    warm = _rounds(spec, context, 5, spine_target)
    assert context.state.warm and context.state.rounds == 5
    reached = max(t.max_depth for t in warm)
    later = _rounds(spec, context, 3, spine_target, seed=1)
    for tree in later:  # every depth it has data for now drafts one child; deeper ones the full width
        for node in range(tree.size):
            kids = children_of(tree, node)
            if kids and tree.depths[node] < reached:
                assert len(kids) == 1
        assert tree.max_depth > max(t.max_depth for t in warm[:1])  # the saved budget went deeper


def test_online_warmup_keeps_the_ranks_the_target_took_during_warmup():
    spec = TreeSpec("online_warmup", 48, 4, {"warmup": 6})
    context = TreeContext.for_request(spec)

    def first_two(tree):  # at the root, rank 1 every other round; below, rank 0
        pick = context.state.rounds % 2
        return lambda node: next((tree.tokens[c] for c in children_of(tree, node)
                                  if tree.ranks[c] == (pick if node == 0 else 0)), -1)

    _rounds(spec, context, 6, first_two)
    assert context.state.table()[0][:2] == pytest.approx((0.5, 0.5))
    tree = _rounds(spec, context, 1, spine_target, seed=3)[0]
    assert len(children_of(tree, 0)) == 2


def test_online_warmup_stops_counting_once_warm_and_uses_the_heads_profile_before():
    spec = TreeSpec("online_warmup", 32, 4, {"warmup": 2})
    profile = AcceptanceProfile(((0.9, 0.001), (0.9, 0.001)))  # rank 0 only at depths 1 and 2
    context = TreeContext.for_request(spec, profile=profile)
    first = _rounds(spec, context, 1, spine_target)[0]
    assert len(children_of(first, 0)) == 1  # before warm-up ends: the head's profile
    _rounds(spec, context, 1, spine_target)
    table = context.state.table()
    _rounds(spec, context, 4, lambda tree: (lambda node: -1))  # rejections after warm-up teach nothing
    assert context.state.table() == table and context.state.rounds == 2


def test_online_warmup_at_threshold_0_stays_accum_logp_after_warmup():
    spec = TreeSpec("online_warmup", 32, 4, {"warmup": 2, "threshold": 0.0})
    context = TreeContext.for_request(spec)
    _rounds(spec, context, 2, spine_target)
    assert context.state.warm
    paper = TreeSpec("accum_logp", 32, 4)
    for seed in range(3):
        assert _rounds(spec, context, 1, spine_target, seed=seed)[0].parents == \
            _rounds(paper, TreeContext(), 1, spine_target, seed=seed)[0].parents


# ---------------------------------------------------------------------------------------------
# template_bandit (planned): epsilon-greedy over shape templates, rewarded per verify


def test_template_bandit_learns_the_chain_when_the_target_accepts_the_spine():
    """Budget 8, width 4: the full fanout (accum_logp) reaches depth 1-2, a chain depth 7; a target that
    accepts the spine rewards the chain most, so exploitation settles on it."""
    spec = TreeSpec("template_bandit", 8, 4, {"epsilon": 0.3})
    context = TreeContext.for_request(spec, seed=5)
    _rounds(spec, context, 60, spine_target, depth=10)
    state = context.state
    means = [r / p if p else -1.0 for r, p in zip(state.rewards, state.pulls)]
    arms = ["full"] + [name for name, _ in SHAPES.bandit_arms]
    assert arms[max(range(len(means)), key=means.__getitem__)] == "chain"
    greedy = TreeSpec("template_bandit", 8, 4, {"epsilon": 0.0})  # the same state, no exploration
    tree = _rounds(greedy, context, 1, spine_target, seed=9, depth=10)[0]
    assert tree.max_depth == tree.size - 1 == 7


def test_template_bandit_at_epsilon_0_never_leaves_accum_logp():
    spec = TreeSpec("template_bandit", 16, 4, {"epsilon": 0.0})
    context = TreeContext.for_request(spec)
    trees = _rounds(spec, context, 10, spine_target)
    assert context.state.pulls[0] == 10 and sum(context.state.pulls) == 10
    assert all(len(children_of(t, 0)) == 4 for t in trees)


def test_template_bandit_credits_the_arm_it_built_and_ignores_rounds_it_did_not():
    state = BanditState(seed=0)
    state.observe(DraftTree.root_only(1), Acceptance([0], 5))  # nothing pending: a plain round
    assert state.pulls == []
    spec = TreeSpec("template_bandit", 8, 4)
    context = TreeContext(state=state)
    _rounds(spec, context, 1, lambda tree: (lambda node: tree.tokens[1] if node == 0 else -1))
    assert state.pulls[0] == 1 and state.rewards[0] == pytest.approx(2 / 8) and state.pending is None


def test_template_bandit_is_reproducible_for_a_seed():
    spec = TreeSpec("template_bandit", 12, 4, {"epsilon": 0.5})
    shapes = [[t.parents for t in _rounds(spec, TreeContext.for_request(spec, seed=7), 20, spine_target)]
              for _ in range(2)]
    assert shapes[0] == shapes[1]


# ---------------------------------------------------------------------------------------------
# path_conditional_refresh (planned): a second head pass re-drafts depths 2..D under the top depth-1 tokens


class FakeRedraft:
    """A stand-in for the head's second pass: for each depth-1 token, D - 1 rows of `width` (log-prob,
    token) that depend on that token (seeded by it), each sorted by descending log-prob. Records its calls."""

    def __init__(self, depth: int, width: int, seed: int = 0, vocab: int = 60):
        self.depth, self.width, self.seed, self.vocab = depth, width, seed, vocab
        self.calls: list[list[int]] = []

    def rows(self, token: int):
        gen = torch.Generator().manual_seed(self.seed * 100_003 + token)
        top = torch.topk(torch.log_softmax(torch.randn(self.depth - 1, self.vocab, generator=gen) * 3, -1),
                         self.width, -1)
        return top.values.tolist(), top.indices.tolist()

    def __call__(self, branches):
        self.calls.append(list(branches))
        rows = [self.rows(c) for c in branches]
        return [r[0] for r in rows], [r[1] for r in rows]


def refresh_rule(root: int, logp, tokens, budget: int, k: int, refreshed: dict) -> DraftTree:
    """path_conditional_refresh stated without a heap: the paper's rule (`paper_rule`) at fanout k, where the
    children of a node below the depth-1 token of rank r come from refreshed[r]'s row of their depth when r
    was refreshed."""
    def rows(tree: DraftTree, node: int):
        d = tree.depths[node]
        top = tree.path_to(node)[1:2]  # the depth-1 ancestor (or the node itself); none for the root
        branch = tree.ranks[top[0]] if top else None
        if branch in refreshed:
            return refreshed[branch][0][d - 1], refreshed[branch][1][d - 1]
        return logp[d], tokens[d]

    return paper_rule(root, logp, tokens, budget, [k] * len(logp), rows)


@FAST
@given(rows=draft_rows(), budget=budgets, root=roots, branches=st.integers(0, 8), seed=st.integers(0, 99))
def test_path_conditional_refresh_is_the_papers_rule_on_each_branchs_redrafted_rows(rows, budget, root, branches,
                                                                                  seed):
    logp, tokens = rows
    k = len(logp[0])
    redraft = FakeRedraft(len(logp), k, seed)
    tree = build("path_conditional_refresh", root, logp, tokens, budget, context=TreeContext(redraft=redraft),
                 branches=branches, gap=1e9)
    opens = len(logp) >= 2 and k >= 2 and budget > 1 + k and logp[0][0] - logp[0][1] < 1e9 and branches > 0
    assert redraft.calls == ([list(tokens[0][:min(branches, k)])] if opens else [])
    refreshed = {r: redraft.rows(tokens[0][r]) for r in range(min(branches, k))} if opens else {}
    assert_same_tree(tree, refresh_rule(root, logp, tokens, budget, k, refreshed))


@FAST
@given(rows=draft_rows(), budget=budgets, root=roots, data=st.data())
def test_path_conditional_refresh_is_accum_logp_at_its_identity_settings(rows, budget, root, data):
    """branches 0, gap 0, or no second pass to call (no context, or a context without one): accum_logp,
    node for node, and the head is never called."""
    logp, tokens = rows
    paper = build("accum_logp", root, logp, tokens, budget)
    redraft = FakeRedraft(len(logp), len(logp[0]))
    for context, params in ((None, {}), (TreeContext(), {"gap": 1e9}),
                            (TreeContext(redraft=redraft), {"branches": 0, "gap": 1e9}),
                            (TreeContext(redraft=redraft), {"gap": 0.0, "branches": data.draw(st.integers(0, 8))})):
        assert_same_tree(build("path_conditional_refresh", root, logp, tokens, budget, context=context, **params),
                         paper)
    assert redraft.calls == []


def test_path_conditional_refresh_pays_for_a_second_pass_only_where_it_can_change_the_tree():
    """The gate: an uncertain depth 1 (top-2 gap below `gap`) and a budget that reaches depth 2 (> 1 +
    fanout) — then the top `branches` depth-1 tokens are re-drafted, and the tree differs from accum_logp."""
    uncertain, decisive = rows_with_gaps([0.3, 0.2, 0.2]), rows_with_gaps([3.0, 0.2, 0.2])
    for (logp, tokens), budget, called in ((uncertain, 32, True), (decisive, 32, False), (uncertain, 5, False),
                                           (uncertain, 6, True)):
        redraft = FakeRedraft(3, 4, vocab=500)
        tree = build("path_conditional_refresh", 0, logp, tokens, budget, context=TreeContext(redraft=redraft))
        assert redraft.calls == ([[100, 101]] if called else [])  # branches 2 by default: ranks 0 and 1
        paper = build("accum_logp", 0, logp, tokens, budget)
        assert (tree.tokens != paper.tokens) == called
    with pytest.raises(InvalidSettingError, match="whole number"):
        TreeSpec("path_conditional_refresh", params={"branches": 1.5})


def test_the_context_carries_a_rounds_second_pass_and_keeps_the_requests_state():
    spec = TreeSpec("online_warmup", 12, 4)
    context = TreeContext.for_request(spec, profile=PROFILE)
    round_context = context.with_redraft(FakeRedraft(3, 4))
    assert round_context.state is context.state and round_context.profile is context.profile
    assert context.redraft is None and round_context.redraft is not None


# ---------------------------------------------------------------------------------------------
# the README says where each algorithm comes from


def test_the_readme_lists_every_algorithm_under_its_source():
    text = README.read_text()
    groups = {"paper": r"From the paper", "planned": r"Planned by the paper", "ours": r"Ours"}
    for source, title in groups.items():
        item = re.search(rf"^- \*\*{title}\*\*.*(?:\n  .*)*", text, re.MULTILINE)  # the bullet, continuations too
        assert item, f"README has no '- **{title}**' item in its list of tree algorithms"
        named = set(re.findall(r"`([a-z0-9_]+)[`:]", item.group(0)))
        expected = {a for a in ALGORITHMS if TREE_BUILDERS[a].source == source}
        assert expected <= named, f"README's {title} line misses {sorted(expected - named)}"


# ---------------------------------------------------------------------------------------------
# lossless with a context and the feedback hook, on real decoding


class TreeHooks:
    """Watches the reference decoder's own hooks: records, per round, whether its tree differed from
    accum_logp on the same draft; with `context` set, each request gets that context (say, an online state
    fed beforehand) in place of the fresh one the decoder makes (`request_tree_context`)."""

    def __init__(self, monkeypatch):
        from jetflow.decode import decoder as module

        self.context: TreeContext | None = None
        self.shaped: list[bool] = []
        real_build, real_context = module.build_tree, module.request_tree_context

        def build(spec, root, logp, tokens, context=None):
            tree = real_build(spec, root, logp, tokens, context)
            paper = real_build(TreeSpec("accum_logp", spec.budget, spec.width), root, logp, tokens)
            self.shaped.append((tree.tokens, tree.parents) != (paper.tokens, paper.parents))
            return tree

        def request_context(*args, **kwargs):
            return self.context if self.context is not None else real_context(*args, **kwargs)

        monkeypatch.setattr(module, "build_tree", build)
        monkeypatch.setattr(module, "request_tree_context", request_context)


PROFILE = AcceptanceProfile(((0.6, 0.1, 0.03, 0.01), (0.5, 0.05), (0.4, 0.03), (0.3,)),
                            {"uncertain_task": ((0.5, 0.2, 0.1), (0.4, 0.1))})
ONLINE = {"online_warmup": {"warmup": 3}, "template_bandit": {"epsilon": 0.3}}


def _context(spec: TreeSpec, seed: int) -> TreeContext:
    return TreeContext.for_request(spec, profile=PROFILE, seed=seed,
                                   prompt=PromptInfo(task="mtbench", text="Write a short story about a robot."))


@pytest.fixture(scope="module")
def greedy_reference(smollm):
    """(prompt ids, HF greedy continuation) of an MT-Bench prompt, and a random causal head."""
    from jetflow.data import load_prompts
    from jetflow.decode import encode_prompt
    from jetflow.head import DraftHead, HeadConfig

    ids = encode_prompt(smollm.tokenizer, load_prompts("mtbench", limit=1)[0].chat)
    gen = smollm.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20,
                                pad_token_id=smollm.tokenizer.pad_token_id)
    torch.manual_seed(0)
    return ids, gen[0, len(ids):].tolist(), DraftHead(HeadConfig.for_target(smollm))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_with_its_context_decodes_token_identical_to_greedy(smollm, greedy_reference, monkeypatch,
                                                                            algorithm):
    """Greedy, fp32, the real bundled SmolLM2: a random head carrying a profile and a noisy oracle (deep,
    off-spine acceptance, so the online shapers learn something); the decoder makes each request's context
    itself (the head's profile, the task label, the prompt's text, a fresh online state) and observes every
    round."""
    from jetflow.decode import DecodeConfig, Decoder
    from tests.conftest import OracleDecoder, assert_greedy

    ids, expected, head = greedy_reference
    hooks = TreeHooks(monkeypatch)
    spec = TreeSpec(algorithm, 24, 7, ONLINE.get(algorithm, {}))
    monkeypatch.setattr(head, "tree_profile", PROFILE)
    for decoder in (Decoder(smollm, head), OracleDecoder(smollm, head, reference=ids + expected, seed=1)):
        result = decoder.generate(ids, DecodeConfig(tree=spec, max_new_tokens=len(expected)), task="mtbench")
        assert_greedy(smollm, ids, result.token_ids, expected)
        assert max(result.stats.tree_nodes) <= 24
    if algorithm not in ("accum_logp", "chain"):  # a chain is accum_logp at width 1
        assert any(hooks.shaped), f"{algorithm} drafted accum_logp's tree in every round"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_with_its_context_samples_the_targets_distribution(monkeypatch, algorithm):
    """T = 1 on a tiny target (vocab 8) where trees hit often: the first two sampled tokens follow the exact
    AR distribution (chi-square). Online states start pre-fed, so their trees are already shaped."""
    from collections import Counter

    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.head import DraftHead, HeadConfig
    from tests.conftest import tiny_target
    from tests.test_sampling_lossless import LOGIT_SCALE, PROMPT, VOCAB, _chi_square_p, _exact_two_token_distribution

    runs = 400
    hooks = TreeHooks(monkeypatch)
    target = tiny_target("llama", vocab=VOCAB, seed=11, logit_scale=LOGIT_SCALE, layers=2)
    exact = _exact_two_token_distribution(target, 1.0, 0, 1.0)
    torch.manual_seed(0)
    decoder = Decoder(target, DraftHead(HeadConfig.for_target(target, block_size=4)))
    spec = TreeSpec(algorithm, 12, 4, ONLINE.get(algorithm, {}))
    samples: Counter = Counter()
    for seed in range(runs):
        hooks.context = _context(spec, seed)
        rnd = random.Random(seed)
        _rounds(spec, hooks.context, 4, lambda tree: (lambda node: rnd.choice(
            [tree.tokens[c] for c in children_of(tree, node)] + [-1])), seed=seed, depth=3, width=4)
        cfg = DecodeConfig(tree=spec, temperature=1.0, max_new_tokens=2, seed=seed)
        samples[tuple(decoder.generate(PROMPT, cfg).token_ids)] += 1
    assert _chi_square_p(samples, exact) > 1e-3


@pytest.mark.parametrize("algorithm", ["online_warmup", "template_bandit", "task_router", "depth_rank_histogram",
                                       "path_conditional_refresh"])
def test_the_engine_gives_each_request_the_decoders_context_and_feedback(algorithm):
    """Batched, two requests at once: each request's trees — shaped from the head's profile, its task label
    and its own online state, fed after every verify — are round for round the ones the reference decoder
    builds for that request alone (same sizes, same tokens committed per round)."""
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.engine import Engine, EngineConfig
    from jetflow.head import DraftHead, HeadConfig
    from tests.conftest import tiny_target

    target = tiny_target("llama", vocab=16, seed=3, logit_scale=4.0, layers=2)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=5))
    head.tree_profile = PROFILE
    spec = TreeSpec(algorithm, 12, 4, ONLINE.get(algorithm, {}))
    prompts = [[5, 9, 11, 3, 2], [7, 7, 8, 1, 14, 4, 3]]
    configs = [DecodeConfig(tree=spec, max_new_tokens=40, temperature=1.0, seed=s) for s in range(2)]
    decoder = Decoder(target, head)
    reference = [decoder.generate(p, c, task="humaneval").stats for p, c in zip(prompts, configs)]
    got = [g.stats for g in Engine(target, head, EngineConfig(max_slots=2)).generate(prompts, configs,
                                                                                       ["humaneval"] * 2)]
    for ref, stats in zip(reference, got):
        assert stats.tree_nodes == ref.tree_nodes
        assert stats.committed_per_round == ref.committed_per_round
        assert stats.redrafts == ref.redrafts  # path_conditional_refresh: the same rounds paid a second pass
    paper = Decoder(target, head).generate(prompts[0], DecodeConfig(tree=TreeSpec("accum_logp", 12, 4),
                                                                    max_new_tokens=40, temperature=1.0, seed=0))
    if algorithm == "path_conditional_refresh":  # same sizes as accum_logp: the second pass changes tokens
        assert reference[0].redrafts > 0 and paper.stats.redrafts == 0
    else:
        assert (paper.stats.tree_nodes, paper.stats.committed_per_round) != (
            reference[0].tree_nodes, reference[0].committed_per_round), f"{algorithm} drafted accum_logp's trees"
        assert reference[0].redrafts == 0
