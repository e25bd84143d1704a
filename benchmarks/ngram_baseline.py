"""How well should a head draft depth 1? An n-gram baseline from the same regenerated data.

    python benchmarks/ngram_baseline.py --data $JETFLOW_HOME/data/regen/<key> [--held-out 40]
        [--head demo --features $JETFLOW_HOME/features/<key>]

Counts bigrams (and trigrams, backing off to bigrams) over the response tokens of all but the last
`--held-out` regenerated sequences, then reports how often the most frequent continuation is the
target's next token on the held-out ones: the depth-1 question a head answers (given the tokens up to
the anchor, what comes after it), answered by counting. With `--head`/`--features` it also prints the
head's depth-1 and depth-2 agreement on its own held-out split and on as many of its training
sequences (the trainer's monitor), to tell an under-trained head from a data-starved one.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path


def ngram_accuracy(sequences: list[list[int]], held_out: int) -> dict[str, float]:
    """sequences: [last prompt token] + response ids each. Top-1 next-token accuracy on the last
    `held_out` sequences of a bigram table and of a trigram table backing off to it."""
    train, test = sequences[:-held_out], sequences[-held_out:]
    bigram: dict[int, Counter] = defaultdict(Counter)
    trigram: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for s in train:
        for i in range(len(s) - 1):
            bigram[s[i]][s[i + 1]] += 1
            if i:
                trigram[(s[i - 1], s[i])][s[i + 1]] += 1
    hits2 = hits3 = total = 0
    for s in test:
        for i in range(1, len(s) - 1):
            total += 1
            guess2 = bigram[s[i]].most_common(1)[0][0] if bigram.get(s[i]) else None
            counts3 = trigram.get((s[i - 1], s[i]))
            guess3 = counts3.most_common(1)[0][0] if counts3 else guess2
            hits2 += guess2 == s[i + 1]
            hits3 += guess3 == s[i + 1]
    return {"positions": total, "bigram": hits2 / max(total, 1), "trigram_backoff": hits3 / max(total, 1)}


def head_agreement(head: str, features: Path, model: str) -> dict[str, dict[str, float]]:
    from jetflow.data.features import FeatureCache
    from jetflow.head import load_head
    from jetflow.head.ref import local_head_path
    from jetflow.target import TargetModel
    from jetflow.train.config import TrainConfig
    from jetflow.train.trainer import held_out_and_training

    head_dir = local_head_path(head)
    head = load_head(head_dir)
    target = TargetModel.load(model)
    data = FeatureCache(features)
    cfg = TrainConfig(**json.loads((head_dir / "train_config.json").read_text()))
    return {name: {k.removeprefix("eval/"): round(v, 3) for k, v in result.as_metrics().items()
                   if k in ("eval/agree_d1", "eval/agree_d2", "eval/tree_tau")}
            for name, result in held_out_and_training(head, target, data, cfg).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a regeneration folder (shards + manifest.json)")
    p.add_argument("--held-out", type=int, default=40, help="sequences held out from the counts")
    p.add_argument("--head", help="a head folder or a name under $JETFLOW_HOME/heads/")
    p.add_argument("--features", type=Path, help="the feature cache the head was trained on")
    args = p.parse_args()

    from jetflow.data.regenerate import MANIFEST, load_regenerated

    data = load_regenerated(args.data)
    sequences = [prompt[-1:] + response for prompt, response in zip(data["prompt_ids"], data["response_ids"])]
    if not 0 < args.held_out < len(sequences):
        raise SystemExit(f"--held-out must be in 1..{len(sequences) - 1}")
    print(json.dumps({"sequences": len(sequences), **ngram_accuracy(sequences, args.held_out)}))
    if args.head:
        if not args.features:
            raise SystemExit("--head needs --features (the cache it was trained on)")
        model = json.loads((args.data / MANIFEST).read_text())["settings"]["model"]
        print(json.dumps(head_agreement(args.head, args.features, model)))


if __name__ == "__main__":
    main()
