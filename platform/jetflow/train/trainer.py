"""The head training loop (Ray-agnostic): all anchored blocks of a sequence in one forward under the
block-causal training mask, AdamW with warmup + cosine, checkpoints every K steps, exact resume.

Determinism: the sequence order of every epoch and the anchors of every sequence derive from
(seed, epoch) and (seed, global sequence index), so a run resumed from a checkpoint continues
exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from jetflow.data.features import FeatureCache
from jetflow.head import DraftHead, save_head
from jetflow.head.copy import copy_inputs
from jetflow.train.blocks import block_inputs, block_labels, sample_anchors, training_mask
from jetflow.train.config import TrainConfig
from jetflow.train.losses import draft_loss
from jetflow.train.monitor import HeadEval, summarize

STATE = "trainer_state.pt"


def build_head(cfg: TrainConfig, target, layer_ids: list[int]) -> DraftHead:
    torch.manual_seed(cfg.seed)
    head = DraftHead(cfg.head_config(target, layer_ids))
    if cfg.draft_vocab_size:
        from jetflow.data.vocab import build_draft_vocab
        from jetflow.decode.prompt import stop_token_ids

        head.set_draft_vocab(build_draft_vocab(target.tokenizer, cfg.draft_vocab_size, always=stop_token_ids(target),
                                               vocab_size=target.vocab_size))
    if cfg.init_from_target:
        src = target.model.model.layers[-cfg.num_hidden_layers:]
        for dst, layer in zip(head.layers, src):
            own = dst.state_dict()
            own.update({k: v for k, v in layer.state_dict().items() if k in own and own[k].shape == v.shape})
            dst.load_state_dict(own)
    if cfg.zero_init:
        # zero residual writes: every layer starts as the identity. (A damped final norm, 0.05, started
        # the loss near ln(V) but throttled learning — Adam moves that weight <= lr per step: on one
        # sequence the loss after 35 steps was 5.6 damped vs 3.6 undamped. So the norm stays at 1.)
        head.identity_layers()
    return head


def block_forward(head: DraftHead, target, seq: dict, anchors: torch.Tensor, feature_noise: float = 0.0,
                  generator: torch.Generator | None = None):
    """One sequence, all its blocks in one forward → draft logits (N, D, V') over the head's output
    vocabulary and labels (N, D) as indices into it (-1: outside a draft vocabulary). `feature_noise`:
    see TrainConfig (training steps only), drawn from `generator`."""
    cfg = head.config
    tokens = seq["tokens"]
    s = tokens.shape[0]
    ctx = head.project_context(seq["features"].float(), noise=feature_noise, generator=generator)[None]
    ids, pos = block_inputs(tokens, anchors, cfg.block_size, cfg.mask_token_id)
    with torch.no_grad():
        block = target.embed(ids)[None]
    mask = training_mask(anchors, s, cfg.block_size, cfg.causal)
    copy = copy_inputs(head, target, tokens, anchors.tolist())
    h = head(ctx, block.to(ctx.dtype), torch.arange(s, device=tokens.device)[None], pos[None], mask, copy)[0]
    h = h.view(anchors.shape[0], cfg.block_size, -1)[:, 1:]
    logits = head.output_logits(target, h).float()  # the loss in fp32 under a bf16/fp16 target
    return logits, head.to_draft_index(block_labels(tokens, anchors, cfg.block_size))


def _teacher(seq: dict, anchors: torch.Tensor, head: DraftHead):
    """The teacher's top-K (ids as indices into the head's output vocabulary, -1 outside; log-probs)."""
    rows = anchors[:, None] + torch.arange(head.config.block_size - 1, device=anchors.device)  # row a+k-1: x_{a+k}
    return head.to_draft_index(seq["teacher_ids"][rows].long()), seq["teacher_logp"][rows]


def _anchors(cfg: TrainConfig, seq: dict, index: int, block_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)  # on the CPU: the same anchors anywhere
    anchors = sample_anchors(seq["response_start"], seq["tokens"].shape[0], block_size, cfg.anchors_per_seq, gen)
    return anchors.to(seq["tokens"].device)


def _on(seq: dict, device) -> dict:
    """A cached sequence's tensors on the training device (the target's)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in seq.items()}


@torch.no_grad()
def evaluate(head: DraftHead, target, data: FeatureCache, indices: list[int], cfg: TrainConfig) -> HeadEval:
    head.eval()
    all_logits, all_labels = [], []
    for i in indices:
        seq = _on(data[i], target.device)
        anchors = _anchors(cfg, seq, -1 - i, head.config.block_size)
        if anchors.numel():
            logits, labels = block_forward(head, target, seq, anchors)
            all_logits.append(logits)
            all_labels.append(labels)
    head.train()
    return summarize(torch.cat(all_logits), torch.cat(all_labels), cfg.eval_tree)


def held_out_and_training(head: DraftHead, target, data: FeatureCache, cfg: TrainConfig) -> dict[str, HeadEval]:
    """The monitor on the run's held-out split and on as many of its training sequences: the gap tells an
    over-fitting head from an under-trained one."""
    train_idx, eval_idx = split_indices(len(data), cfg.eval_sequences, cfg.seed)
    return {"held_out": evaluate(head, target, data, eval_idx, cfg),
            "training": evaluate(head, target, data, train_idx[: len(eval_idx)], cfg)}


def split_indices(n: int, eval_sequences: int, seed: int) -> tuple[list[int], list[int]]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(eval_sequences, max(1, n // 10))
    return perm[k:], sorted(perm[:k])


def train(cfg: TrainConfig, target, data: FeatureCache, out: Path, log: Callable[[dict, int], None] | None = None,
          stop_after: int | None = None, progress: bool = True, rank: int = 0, world: int = 1,
          on_start: Callable[[DraftHead, dict], None] | None = None, resume_state: dict | None = None,
          local_checkpoints: bool = True, on_checkpoint: Callable[[int, Path | None], None] | None = None) -> dict:
    """Train (or resume) a head into `out`; returns the final metrics. `log(metrics, step)` gets every
    optimizer step's metrics (loss, lr, epoch, drafted tokens/s; the held-out monitor's when it runs) and
    the final ones. `on_start(head, schedule)` is called once the head is built and any checkpoint
    restored; `schedule` has total_steps, steps_per_epoch, warmup_steps, train_sequences, eval_sequences
    and start_step (> 0 when resuming). `stop_after` ends the run early after that many optimizer steps
    (a simulated kill, for tests).

    Resume: from `resume_state` (a checkpoint's state, the same on every rank: Ray Train's, from cluster
    storage) or from `out/checkpoints` (`local_checkpoints`: this node's own), whichever is further along.
    `on_checkpoint(step, folder)` is called on every rank after each checkpoint (rank 0 gets the folder it
    wrote, the others None): where Ray Train reports it."""
    from tqdm import tqdm

    out = Path(out)
    layer_ids = data.meta["spec"]["layer_ids"]
    # the head trains in fp32 (its master weights) on the target's device, whatever the target's dtype
    head = build_head(cfg, target, layer_ids).to(target.device)
    train_idx, eval_idx = split_indices(len(data), cfg.eval_sequences, cfg.seed)
    if cfg.max_sequences:
        train_idx = train_idx[: cfg.max_sequences]  # the held-out split stays the same across data sizes
    steps_per_epoch = max(1, len(train_idx) // cfg.seqs_per_step)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    warmup = max(1, int(cfg.warmup_frac * total))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))
    step = 0
    ckpt_root = out / "checkpoints"
    latest = latest_checkpoint(ckpt_root) if local_checkpoints else None
    state = resume_state
    if latest is not None and (state is None or checkpoint_step(latest) > state["step"]):
        state = torch.load(latest / STATE, weights_only=False, map_location="cpu")
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
    head.train()
    if on_start:
        on_start(head, {"total_steps": total, "steps_per_epoch": steps_per_epoch, "warmup_steps": warmup,
                        "train_sequences": len(train_idx), "eval_sequences": len(eval_idx), "start_step": step})
    metrics: dict = {}
    t0 = time.perf_counter()
    tokens_seen = 0
    bar = tqdm(total=total, initial=step, desc=f"train {cfg.name}", disable=not progress or rank != 0)
    while step < total:
        epoch, within = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        batch = order[within * cfg.seqs_per_step : (within + 1) * cfg.seqs_per_step][rank::world]
        opt.zero_grad(set_to_none=True)
        loss_sum, blocks = 0.0, 0
        for j in batch:
            seq = _on(data[train_idx[j]], target.device)
            anchors = _anchors(cfg, seq, step * cfg.seqs_per_step + j, cfg.block_size)
            if anchors.numel() == 0:
                continue
            # the noise is seeded like the anchors, so a resumed run draws what an uninterrupted one does
            noise_gen = (torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * cfg.seqs_per_step + j + 7)
                         if cfg.feature_noise else None)
            logits, labels = block_forward(head, target, seq, anchors, cfg.feature_noise, noise_gen)
            t_ids, t_logp = _teacher(seq, anchors, head)
            loss = draft_loss(logits, labels, t_ids, t_logp, cfg.loss, cfg.gamma) / cfg.seqs_per_step
            loss.backward()
            loss_sum += loss.item()
            blocks += anchors.numel()
            tokens_seen += anchors.numel() * (cfg.block_size - 1)
        if world > 1:  # data parallel: average gradients over workers (each took its slice of the batch)
            import torch.distributed as dist

            for p in head.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        elapsed = time.perf_counter() - t0
        metrics = {"train/loss": loss_sum, "train/lr": sched.get_last_lr()[0], "train/blocks": blocks,
                   "train/epoch": step / steps_per_epoch,
                   # this worker's drafted positions per second since this (possibly resumed) session began
                   "train/draft_tokens_per_s": tokens_seen / elapsed if elapsed else 0.0}
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            metrics.update(evaluate(head, target, data, eval_idx, cfg).as_metrics())
        if log:
            log(metrics, step)
        if step % cfg.checkpoint_every == 0 or step == total:
            saved = _save_checkpoint(ckpt_root, step, head, opt, sched) if rank == 0 else None
            if on_checkpoint:
                on_checkpoint(step, saved)
        if stop_after is not None and step >= stop_after and step < total:
            bar.close()
            return {"stopped_at": step}
    bar.close()
    seconds = time.perf_counter() - t0
    result = evaluate(head, target, data, eval_idx, cfg)
    metrics.update(result.as_metrics())
    metrics.update({"train/seconds": seconds, "train/steps": step, "train/threads": torch.get_num_threads(),
                    "train/draft_tokens_per_s": tokens_seen / seconds if seconds else 0.0})
    if log:
        log(metrics, step)
    if rank == 0:
        save_head(head, out)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return metrics


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under `root` (a head folder's checkpoints/), or None."""
    done = sorted(p for p in root.glob("step-*") if (p / STATE).exists()) if root.exists() else []
    return done[-1] if done else None


def checkpoint_step(folder: Path) -> int:
    """The optimizer step of a checkpoint folder (`step-0000042`)."""
    return int(folder.name.rsplit("-", 1)[-1])


def _save_checkpoint(root: Path, step: int, head, opt, sched, keep: int = 2) -> Path:
    path = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step}, tmp / STATE)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)  # a checkpoint exists only when complete
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path
