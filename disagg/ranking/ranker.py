"""`LengthRanker`: scores a tokenized prompt by how long its answer will be (higher = longer),
and turns a score into a length for the engine's `ltr` order (disagg.engine.queue_order).

A linear scorer over disagg.ranking.features: microseconds a prompt, no model call. The score
is trained to order (disagg.ranking.losses), so its value means nothing by itself; the length
comes from a calibration fitted at training time: the quantiles of the training scores mapped
onto the quantiles of the training lengths. That map is monotonic, so predicted lengths keep
the scores' order, and their spread is the data's.

The file is torch.save of plain tensors and numbers (loaded with weights_only: no code runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from disagg.ranking.features import DEFAULT_NUM_BUCKETS, num_features, prompt_features

FILE_FORMAT = "disagg-length-ranker"
FILE_VERSION = 1
NUM_QUANTILES = 65  # calibration points: 0%, 1/64, ..., 100%
DEFAULT_RANKER_FILE = Path(__file__).with_name("smollm2_length_ranker.pt")


class LengthRanker:
    def __init__(
        self,
        weight: torch.Tensor,
        bias: float = 0.0,
        num_buckets: int = DEFAULT_NUM_BUCKETS,
        calibration: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        if weight.shape != (num_features(num_buckets),):
            raise ValueError(f"length ranker: weight of shape {tuple(weight.shape)} for {num_buckets} buckets")
        self.weight = weight.detach().to(torch.float32)
        self.bias = float(bias)
        self.num_buckets = num_buckets
        # (score quantiles, length quantiles), both ascending; None: not calibrated yet.
        self.calibration = calibration

    @classmethod
    def untrained(cls, num_buckets: int = DEFAULT_NUM_BUCKETS) -> "LengthRanker":
        return cls(torch.zeros(num_features(num_buckets)), 0.0, num_buckets)

    # ---- scoring -----------------------------------------------------------------------------
    def features(self, token_ids: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(prompt_features(token_ids, self.num_buckets))

    def score(self, token_ids: Sequence[int]) -> float:
        """Higher means a longer output predicted."""
        return float(self.features(token_ids) @ self.weight) + self.bias

    def predict_len(self, token_ids: Sequence[int]) -> int:
        """The calibrated length of the score (at least 1)."""
        if self.calibration is None:
            raise ValueError("length ranker: not calibrated (fit_calibration after training)")
        score_quantiles, length_quantiles = self.calibration
        return max(1, int(round(float(np.interp(self.score(token_ids), score_quantiles, length_quantiles)))))

    def fit_calibration(self, scores: Sequence[float], lengths: Sequence[int]) -> None:
        """Quantile mapping of `scores` onto `lengths` (the training set's)."""
        levels = np.linspace(0.0, 1.0, NUM_QUANTILES)
        score_quantiles = np.quantile(np.asarray(scores, dtype=np.float64), levels)
        length_quantiles = np.quantile(np.asarray(lengths, dtype=np.float64), levels)
        self.calibration = (np.maximum.accumulate(score_quantiles), length_quantiles)

    # ---- file --------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        if self.calibration is None:
            raise ValueError("length ranker: calibrate before saving (predict_len needs it)")
        torch.save(
            {
                "format": FILE_FORMAT,
                "version": FILE_VERSION,
                "num_buckets": self.num_buckets,
                "weight": self.weight.clone(),
                "bias": self.bias,
                "score_quantiles": torch.from_numpy(self.calibration[0].copy()),
                "length_quantiles": torch.from_numpy(self.calibration[1].copy()),
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> "LengthRanker":
        state = _read_state(path)
        try:
            calibration = (state["score_quantiles"].numpy(), state["length_quantiles"].numpy())
            return cls(state["weight"], float(state["bias"]), int(state["num_buckets"]), calibration)
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"length ranker {path}: not a valid ranker file ({e})") from None


def _read_state(path: str | Path) -> dict:
    """The file's dict, checked to be ours; ValueError for anything else."""
    if not Path(path).is_file():
        raise ValueError(f"length ranker {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a file that is not its own
        raise ValueError(f"length ranker {path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
        raise ValueError(f"length ranker {path}: not a {FILE_FORMAT} file")
    if state.get("version") != FILE_VERSION:
        raise ValueError(f"length ranker {path}: version {state.get('version')!r}, this code reads {FILE_VERSION}")
    return state
