"""Train a `LengthRanker` with ListMLE on lists of prompts, report Kendall's tau on held-out
prompts, write the ranker file.

    python -m disagg.ranking.train --data loadtest/data/ranking_smollm2.jsonl \
        --out disagg/ranking/smollm2_length_ranker.pt

The data: JSONL of {"prompt_token_ids": [...], "output_len": n} (disagg.ranking.dataset). The
held-out set: the records whose "split" is "heldout" where the data says (dataset.py fills
those from word banks the training prompts never use), else a seeded random 20%.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from disagg.ranking.dataset import read_jsonl
from disagg.ranking.evaluation import kendall_tau_b
from disagg.ranking.features import DEFAULT_NUM_BUCKETS, feature_matrix
from disagg.ranking.losses import list_mle
from disagg.ranking.ranker import LengthRanker

HELDOUT_FRACTION = 0.2


@dataclass(frozen=True)
class TrainConfig:
    list_size: int = 32  # prompts per ranked list
    lists_per_step: int = 16
    steps: int = 400
    lr: float = 0.05
    # Thousands of buckets, hundreds of prompts: weights of words seen in a few prompts are weak
    # evidence. 0.1 over 1e-3 gave +0.01 held-out tau on the SmolLM2 dataset (three seeds).
    weight_decay: float = 0.1
    num_buckets: int = DEFAULT_NUM_BUCKETS
    seed: int = 0


def split_records(records: list[dict], seed: int = 0) -> tuple[list[dict], list[dict], str]:
    """(train, held-out, how they were split)."""
    if records and all("split" in r for r in records):
        heldout = [r for r in records if r["split"] == "heldout"]
        if heldout and len(heldout) < len(records):
            return [r for r in records if r["split"] != "heldout"], heldout, "held-out word banks"
    shuffled = records[:]
    random.Random(seed).shuffle(shuffled)
    cut = int(len(shuffled) * (1 - HELDOUT_FRACTION))
    return shuffled[:cut], shuffled[cut:], "random 20%"


def train_scorer(features: np.ndarray, lengths: np.ndarray, config: TrainConfig) -> tuple[torch.Tensor, float]:
    """(weight, bias) of a linear scorer fitted with ListMLE on random lists of the rows."""
    torch.manual_seed(config.seed)
    x, y = torch.from_numpy(features), torch.from_numpy(lengths.astype(np.float32))
    weight = torch.zeros(x.shape[1], requires_grad=True)
    optimizer = torch.optim.AdamW([weight], lr=config.lr, weight_decay=config.weight_decay)
    list_size = min(config.list_size, len(x))
    for _ in range(config.steps):
        # Each list a random sample, in random order: tied lengths get no fixed preference.
        rows = torch.stack([torch.randperm(len(x))[:list_size] for _ in range(config.lists_per_step)])
        loss = list_mle(x[rows] @ weight, y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return weight.detach(), 0.0  # ListMLE is blind to a constant: no bias to learn


def fit_ranker(train: list[dict], config: TrainConfig) -> LengthRanker:
    features = feature_matrix([r["prompt_token_ids"] for r in train], config.num_buckets)
    lengths = np.array([r["output_len"] for r in train])
    weight, bias = train_scorer(features, lengths, config)
    ranker = LengthRanker(weight, bias, config.num_buckets)
    ranker.fit_calibration((torch.from_numpy(features) @ weight + bias).tolist(), lengths)
    return ranker


def tau_on(ranker: LengthRanker, records: list[dict]) -> float:
    scores = [ranker.score(r["prompt_token_ids"]) for r in records]
    return kendall_tau_b(scores, [r["output_len"] for r in records])


def template_baseline_tau(train: list[dict], heldout: list[dict]) -> float | None:
    """Tau of a predictor that knows each prompt's template and guesses the median length of
    that template in training: how much of the ranker's tau the template alone explains. None
    where the data names no templates."""
    if not all("template" in r for r in train + heldout):
        return None
    lengths_by_template: dict[str, list[int]] = {}
    for r in train:
        lengths_by_template.setdefault(r["template"], []).append(r["output_len"])
    medians = {t: statistics.median(lengths) for t, lengths in lengths_by_template.items()}
    guesses = [medians.get(r["template"], 0.0) for r in heldout]
    return kendall_tau_b(guesses, [r["output_len"] for r in heldout])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--random-split", action="store_true", help="ignore the data's split: a random 20%%")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a few hundred small lists: threads would only contend
    records = read_jsonl(args.data)
    if args.random_split:
        records = [{k: v for k, v in r.items() if k != "split"} for r in records]
    train, heldout, how = split_records(records, args.seed)
    ranker = fit_ranker(train, TrainConfig(steps=args.steps, seed=args.seed))
    print(f"{len(train)} train, {len(heldout)} held out ({how})")
    print(f"train kendall tau: {tau_on(ranker, train):.3f}")
    print(f"kendall tau: {tau_on(ranker, heldout):.3f}")
    baseline = template_baseline_tau(train, heldout)
    if baseline is not None:
        print(f"(for comparison, the template's median training length as the guess: {baseline:.3f})")
    ranker.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
