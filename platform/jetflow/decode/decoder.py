"""The speculative decoder: draft a tree with the head, verify it in one target forward, accept,
keep KV and features for the accepted path only. With no head (or budget 1) the same loop is plain
autoregressive decoding on the same KV machinery — our AR baseline.

Invariant between rounds: the target KV cache and the head's context features cover every
committed token except the last one (the anchor, the root of the next tree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from jetflow.decode.logprobs import TokenLogprob, token_logprobs
from jetflow.decode.prompt import prompt_ids, stop_token_ids
from jetflow.decode.sampling import DecodeConfig, target_probs
from jetflow.decode.stats import DecodeStats
from jetflow.errors import PromptTooLongError
from jetflow.head import DraftHead, check_fits
from jetflow.head.copy import copy_inputs
from jetflow.target import TargetModel
from jetflow.tree import TREE_BUILDERS, DraftTree, PromptInfo, TreeContext, build_tree, observe, walk


@dataclass
class Generation:
    token_ids: list[int]        # generated tokens only (an EOS that ended generation included)
    text: str                   # decoded generated text, cut before a stop string
    finish_reason: str          # "stop" (EOS or stop string) or "length"
    stats: DecodeStats
    logprobs: list[TokenLogprob] | None = None         # per generated token (DecodeConfig.logprobs set)
    prompt_logprobs: list[TokenLogprob] | None = None  # per prompt token but the first (prompt_logprobs set)


@dataclass
class DecodeState:
    """Everything one generation carries between rounds (exposed for streaming and for tests)."""

    prompt_ids: list[int]
    cache: object                       # the target's KV cache: covers prompt + generated[:-1]
    past: int                           # tokens in the cache (= position of the anchor)
    anchor: int                         # last committed token, root of the next tree
    ctx: torch.Tensor | None            # (limit, H) projected context features, rows [:past] valid
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    # per-call buffers (a Decoder may serve several generations at once; none of this is shared)
    positions: torch.Tensor | None = None     # (limit + budget,) arange
    mask_buf: torch.Tensor | None = None      # (1, 1, budget, limit + budget) tree-mask scratch
    mask_ids: torch.Tensor | None = None      # (D,) the MASK token, block inputs after the anchor
    layer_ids: tuple[int, ...] = ()
    rng: torch.Generator | None = None
    lookahead: float = 2.0                    # running mean of the accepted path length (LM-head prefetch)
    tree_context: TreeContext | None = None   # what the request's tree algorithm reads (profile, prompt, state)
    logprobs: list[TokenLogprob] = field(default_factory=list)        # of generated tokens (cfg.logprobs set)
    prompt_logprobs: list[TokenLogprob] | None = None                 # of prompt[1:] (cfg.prompt_logprobs set)


def request_tree_context(head: DraftHead | None, tokenizer, prompt_ids: Sequence[int], cfg: DecodeConfig,
                         task: str | None = None) -> TreeContext | None:
    """The `TreeContext` of one request whose tree algorithm reads one (None otherwise): the head's measured
    profile (`head.tree_profile`), the prompt (its `task` label and decoded text, for the routers) and a fresh
    online state seeded by the request's seed — the same in the reference decoder and in the engine."""
    if head is None or cfg.tree.plain or not TREE_BUILDERS[cfg.tree.algorithm].context:
        return None
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=True) if tokenizer is not None else None
    return TreeContext.for_request(cfg.tree, profile=head.tree_profile, prompt=PromptInfo(task=task, text=text),
                                   seed=cfg.seed or 0)


def round_tree_context(context: TreeContext | None, spec, stats: DecodeStats,
                       second_pass: Callable[[Sequence[int]], tuple[list, list]]) -> TreeContext | None:
    """A request's tree context for one round — the reference decoder's and the engine's alike: with the
    head's second pass (`second_pass(depth-1 tokens)` → rows of depths 2..D per token) when the round's
    algorithm calls one (path_conditional_refresh), each call counted in `stats.redrafts`."""
    if context is None or not TREE_BUILDERS[spec.algorithm].drafter:
        return context

    def redraft(branches: Sequence[int]):
        stats.redrafts += 1
        return second_pass(branches)

    return context.with_redraft(redraft)


def commit_tokens(generated: list[int], tokens: Sequence[int], cfg: DecodeConfig, stop_ids: set[int],
                  tokenizer) -> tuple[int, str | None]:
    """Append a round's tokens (accepted drafts, then the bonus) to `generated` up to the first stop id or
    `max_new_tokens`; → (tokens committed, finish reason: "stop", "length" or None to go on). A stop string
    is looked for in the decoded tail; the text is cut at it by `finish_generation`."""
    committed = 0
    for tok in tokens:
        if len(generated) >= cfg.max_new_tokens:
            break
        generated.append(tok)
        committed += 1
        if tok in stop_ids:
            return committed, "stop"
    if len(generated) >= cfg.max_new_tokens:
        return committed, "length"
    if cfg.stop and tokenizer is not None:
        tail = tokenizer.decode(generated[-64:], skip_special_tokens=True)
        if any(s in tail for s in cfg.stop):
            return committed, "stop"
    return committed, None


def finish_generation(tokenizer, generated: list[int], finish_reason: str | None, cfg: DecodeConfig,
                      stats: DecodeStats, logprobs: list[TokenLogprob] | None = None,
                      prompt_logprobs: list[TokenLogprob] | None = None) -> Generation:
    """The Generation of a finished request: its text cut before the first stop string (the logprobs, when
    asked for, cover every generated token)."""
    text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
    finish = finish_reason or "length"
    if cfg.stop:
        cut = min((text.find(s) for s in cfg.stop if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
    stats.new_tokens = len(generated)
    return Generation(token_ids=list(generated), text=text, finish_reason=finish, stats=stats,
                      logprobs=list(logprobs) if cfg.logprobs is not None and logprobs is not None else None,
                      prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None)


class _PathLogits:
    """Target logits of tree nodes, computed only when the acceptance walk asks for them.

    A request for node x also computes the next `lookahead - 1` nodes of x's rank-0 descendant
    chain (the likeliest continuation): the LM head is memory-bound, so a few rows cost about one.
    """

    def __init__(self, target: TargetModel, hidden: torch.Tensor, tree: DraftTree, lookahead: int):
        self.target, self.hidden, self.lookahead = target, hidden, max(1, lookahead)
        self.rows: dict[int, torch.Tensor] = {}
        self.seconds = 0.0
        self._first_child: dict[int, int] = {}
        for i in range(1, tree.size):
            if tree.ranks[i] == 0:
                self._first_child.setdefault(tree.parents[i], i)

    def __call__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            t0 = time.perf_counter()
            chain = [node]
            while len(chain) < self.lookahead and chain[-1] in self._first_child:
                chain.append(self._first_child[chain[-1]])
            logits = self.target.logits(self.hidden[chain])
            for i, n in enumerate(chain):
                self.rows[n] = logits[i]
            self.seconds += time.perf_counter() - t0
        return self.rows[node]


class Decoder:
    """Lossless tree speculative decoding for one target and (optionally) one draft head: the eager reference
    every other path (the batched engine, the compiled step core) is tested against. Its steps always run eagerly
    (`graphs = "off"`); `jetflow.engine.decoder_for` gives a caller that asks for compiled steps a one-slot engine
    with this class's API instead."""

    graphs = "off"        # how this decoder's steps run (jetflow.engine.SingleStream: "compile")
    graphs_reason = "the reference decoder"
    compile_s = 0.0       # seconds spent compiling (none: nothing is compiled)

    def __init__(self, target: TargetModel, head: DraftHead | None = None):
        if head is not None:
            check_fits(head.config, target)
            head = head.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.head = head
        self.stop_ids = stop_token_ids(target)

    @property
    def compile_log(self) -> dict[str, float]:
        return {}

    def warm(self, prompt_len: int, config: DecodeConfig) -> float:
        """Nothing to compile ahead of a generation: 0 seconds (SingleStream compiles its buckets here)."""
        return 0.0

    # ------------------------------------------------------------------ API
    def encode(self, prompt: str | Sequence[dict] | Sequence[int], raw: bool = False) -> list[int]:
        """Text (a user turn, chat-templated unless raw), chat messages, or token ids → token ids."""
        return prompt_ids(self.target.tokenizer, prompt, raw)

    def generate(self, prompt: str | Sequence[dict] | Sequence[int], config: DecodeConfig | None = None,
                 raw: bool = False, task: str | None = None) -> Generation:
        """`task`: a label for the prompt (a task or prompt-set name), read by the prompt-adaptive tree
        algorithms (task_router, class_histogram)."""
        config = config or DecodeConfig()
        state = None
        for state in self.stream(prompt, config, raw=raw, task=task):
            pass
        assert state is not None
        return self.finish(state, config)

    def stream(self, prompt: str | Sequence[dict] | Sequence[int], config: DecodeConfig,
               raw: bool = False, task: str | None = None) -> Iterator[DecodeState]:
        """Prefill, then yield the state after every round (new tokens: state.generated grows)."""
        ids = self.encode(prompt, raw=raw)
        with torch.inference_mode():
            state = self._prefill(ids, config)
        state.tree_context = request_tree_context(self.head, self.target.tokenizer, ids, config, task)
        while state.finish_reason is None:
            with torch.inference_mode():
                self._round(state, config)
            yield state

    def finish(self, state: DecodeState, cfg: DecodeConfig) -> Generation:
        return finish_generation(self.target.tokenizer, state.generated, state.finish_reason, cfg, state.stats,
                                 state.logprobs, state.prompt_logprobs)

    # ------------------------------------------------------------- the loop
    def _speculative(self, cfg: DecodeConfig) -> bool:
        return self.head is not None and not cfg.tree.plain

    def _prefill(self, prompt_ids: list[int], cfg: DecodeConfig) -> DecodeState:
        target, head = self.target, self.head
        dev = target.device
        if not prompt_ids:
            raise PromptTooLongError("the prompt is empty: give at least one token")
        spec = self._speculative(cfg)
        depth = head.config.depth if spec else 0
        limit = len(prompt_ids) + cfg.max_new_tokens + depth + 1
        if limit > target.max_positions:
            raise PromptTooLongError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) + draft depth "
                f"({depth}) exceeds the target's {target.max_positions} positions; shorten the prompt or "
                "ask for fewer tokens"
            )
        # Per-call buffers: context features, tree mask and positions never reallocate per round.
        rng = torch.Generator(device=dev)  # on the target's device: multinomial draws there
        if cfg.seed is not None:
            rng.manual_seed(cfg.seed)
        state = DecodeState(
            prompt_ids=list(prompt_ids), cache=target.new_cache(), past=len(prompt_ids) - 1, anchor=prompt_ids[-1],
            ctx=torch.empty((limit, target.hidden_size), dtype=target.dtype, device=dev) if spec else None,
            stats=DecodeStats(prompt_tokens=len(prompt_ids)),
            positions=torch.arange(limit + cfg.tree.budget, device=dev),
            mask_buf=(torch.zeros((1, 1, cfg.tree.budget, limit + cfg.tree.budget), dtype=target.dtype, device=dev)
                      if spec else None),
            mask_ids=(torch.full((depth,), head.config.mask_token_id, dtype=torch.long, device=dev)
                      if spec else None),
            layer_ids=tuple(head.config.target_layer_ids) if spec else (),
            rng=rng,
        )
        t0 = time.perf_counter()
        past = state.past
        if past:
            out = target.forward(torch.tensor(prompt_ids[:-1], device=dev), state.positions[:past], state.cache,
                                 None, state.layer_ids)
            if spec:
                state.ctx[:past] = head.project_context(out.features)
            if cfg.prompt_logprobs is not None:  # hidden j predicts prompt token j + 1
                state.prompt_logprobs = token_logprobs(target.logits(out.hidden), prompt_ids[1:], cfg.prompt_logprobs)
        if cfg.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = []  # a one-token prompt
        state.stats.prefill_s = self._now() - t0
        return state

    def draft_logits(self, state: DecodeState, branches: Sequence[int] = ()) -> torch.Tensor:
        """Head forward for the block [anchor, MASK x D] at positions past..past+D → (D, V') logits over the
        head's output vocabulary (V' = its draft vocabulary, or the target's; `head.to_target_ids` maps).
        With `branches` (depth-1 tokens c_1..c_F): one forward of F blocks [anchor, c_r, MASK x (D-1)] → (F,
        D-1, V'), the rows of depths 2..D drafted under each (path_conditional_refresh's second pass)."""
        target, head, past = self.target, self.head, state.past
        block = target.embed(torch.cat([torch.tensor([state.anchor], device=target.device), state.mask_ids]))[None]
        f = max(1, len(branches))
        if branches:
            block = block.repeat(f, 1, 1)
            block[:, 1] = target.embed(torch.tensor(list(branches), device=target.device))
        copy = None
        if head.config.copy_ngram:
            # the committed tokens: the anchor (last of them) stands at position `past`
            embeds, lens = copy_inputs(head, target, state.prompt_ids + state.generated, [past])
            copy = (embeds.expand(f, -1, -1), lens.expand(f, -1))
        h = head(state.ctx[None, :past].expand(f, -1, -1), block, state.positions[None, :past].expand(f, -1),
                 state.positions[None, past : past + head.config.block_size].expand(f, -1), copy=copy)
        return head.output_logits(target, h[:, 2:] if branches else h[0, 1:])

    def draft(self, state: DecodeState, cfg: DecodeConfig,
              branches: Sequence[int] = ()) -> tuple[list[list[float]], list[list[int]]]:
        """Per-depth top-W draft (log-probs, tokens), D rows sorted by descending log-prob (with `branches`:
        per depth-1 token, the rows of depths 2..D drafted under it — see `draft_logits`)."""
        logp = torch.log_softmax(self.draft_logits(state, branches).float(), dim=-1)
        top = torch.topk(logp, min(cfg.tree.width, logp.shape[-1]), dim=-1)
        return top.values.tolist(), self.head.to_target_ids(top.indices).tolist()

    def _round_context(self, state: DecodeState, cfg: DecodeConfig, spent: list[float]) -> TreeContext | None:
        """The request's tree context for this round (`round_tree_context`); the second head pass's seconds
        are added to `spent`, counted as draft time."""
        def second_pass(branches: Sequence[int]):
            t0 = time.perf_counter()
            rows = self.draft(state, cfg, branches)
            spent[0] += self._now() - t0
            return rows

        return round_tree_context(state.tree_context, cfg.tree, state.stats, second_pass)

    def _round(self, state: DecodeState, cfg: DecodeConfig) -> None:
        target, stats, dev, past = self.target, state.stats, self.target.device, state.past
        spec = self._speculative(cfg)
        # 1. draft, 2. tree
        ta = time.perf_counter()
        if spec:
            top_v, top_i = self.draft(state, cfg)
            tb = self._now()
            redraft_s = [0.0]
            tree = build_tree(cfg.tree, state.anchor, top_v, top_i, self._round_context(state, cfg, redraft_s))
        else:
            tb, redraft_s = ta, [0.0]
            tree = DraftTree.root_only(state.anchor)
        tv = time.perf_counter()

        # 3. verify every node in one forward; RoPE position = past + depth
        n = tree.size
        is_path = tree.max_depth == n - 1  # a chain: the plain causal mask is the tree mask
        if is_path:
            positions, mask = state.positions[past : past + n], None
        else:
            positions = tree.depth_tensor(dev) + past
            mask = target.tree_mask(torch.from_numpy(tree.ancestor_mask()).to(dev), past, state.mask_buf)
        out = target.forward(tree.token_tensor(dev), positions, state.cache, mask, state.layer_ids)
        logits_at = _PathLogits(target, out.hidden, tree, round(state.lookahead))
        tw = self._now()

        # 4. accept along the target's own choices (argmax, or a sample at T > 0)
        if cfg.greedy:
            acc = walk(tree, lambda node: int(logits_at(node).argmax()))
        else:
            acc = walk(tree, lambda node: int(torch.multinomial(
                target_probs(logits_at(node), cfg.temperature, cfg.top_k, cfg.top_p), 1, generator=state.rng)))

        if state.tree_context is not None:  # the online algorithms learn from every verified round
            observe(state.tree_context.state, tree, acc)

        # 5. keep KV and features of root + accepted nodes; the bonus becomes the next anchor
        keep = torch.tensor(acc.path, device=dev)
        target.compact_cache(state.cache, past, keep)
        if spec:
            state.ctx[past : past + len(acc.path)] = self.head.project_context(out.features[keep])
        state.past = past + len(acc.path)
        state.anchor = acc.bonus
        committed, state.finish_reason = commit_tokens(
            state.generated, [tree.tokens[i] for i in acc.path[1:]] + [acc.bonus], cfg, self.stop_ids,
            self.target.tokenizer)
        if cfg.logprobs is not None and committed:  # the logits at the path's nodes: the walk computed each
            tokens = state.generated[len(state.generated) - committed:]
            state.logprobs += token_logprobs(torch.stack([logits_at(i) for i in acc.path[:committed]]), tokens,
                                             cfg.logprobs)
        te = self._now()

        stats.draft_s += tb - ta + redraft_s[0]   # a second head pass (path_conditional_refresh) is drafting
        stats.tree_s += tv - tb - redraft_s[0]
        stats.verify_s += (tw - tv) + logits_at.seconds
        stats.accept_s += (te - tw) - logits_at.seconds
        stats.decode_s += te - ta
        stats.rounds += 1
        stats.tree_nodes.append(n)
        stats.committed_per_round.append(committed)
        stats.accepted_depths[acc.accepted] += 1
        for i in acc.path[1:]:
            stats.accepted_ranks[(tree.depths[i], tree.ranks[i])] += 1
        state.lookahead = 0.9 * state.lookahead + 0.1 * len(acc.path)

    def _now(self) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()
