"""Modality-grouped batches for preference training, as VeRL-Omni's `ModalityGroupedBatchSampler`.

Every batch holds rows of one modality (image, video or audio), so a batch never mixes media kinds
in one forward. Training batch k:

    modality_k ~ Categorical(weights over the modalities present)   (generator seeded by (seed, k))
    rows_k     = the next `batch_size` rows of that modality's seeded permutation, a fresh
                 permutation each time the modality's rows are used up

Batch k depends only on (seed, k), so a resumed run sees the batches an uninterrupted one would.
A modality missing from `weights` gets weight 1 (VeRL-Omni's default); weights for modalities the
data lacks are ignored. One difference from VeRL-Omni: rows are drawn without replacement within a
pass over the modality (VeRL-Omni draws them with replacement), so every row is seen equally often.

Validation (`validation_batches`) visits every row once, modality by modality in sorted order, in
row order, keeping the last partial batch of each modality (VeRL-Omni's `replacement=False`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omni_core.errors import ConfigError

MEDIA_COLUMNS = {"images": "image", "videos": "video", "audios": "audio"}


def row_modality(row: Mapping[str, Any], default: str = "text") -> str:
    """`extra_info.modality`, else the first non-empty media column, else the data_source's last part
    when it names a modality (`omni_preference/audio` -> `audio`), else `default`."""
    extra = row.get("extra_info") or {}
    if isinstance(extra, Mapping) and extra.get("modality"):
        return str(extra["modality"])
    for column, modality in MEDIA_COLUMNS.items():
        if row.get(column):
            return modality
    tail = str(row.get("data_source") or "").rsplit("/", 1)[-1]
    return tail if tail in MEDIA_COLUMNS.values() else default


def _group(modalities: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for index, modality in enumerate(modalities):
        groups.setdefault(modality, []).append(index)
    return dict(sorted(groups.items()))


class ModalityGroupedSampler:
    """Single-modality training batches: `batch(step)` -> row indices, deterministic per (seed, step)."""

    def __init__(self, modalities: Sequence[str], batch_size: int, *, seed: int,
                 weights: Mapping[str, float] | None = None):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.groups = _group(modalities)
        if not self.groups:
            raise ConfigError("no rows to sample from: the preference dataset split is empty")
        self.batch_size, self.seed = batch_size, seed
        self.modalities = list(self.groups)
        self.weights = self._weights(weights or {})
        self._draws: list[int] = []  # modality index drawn at each step so far (cache)

    def _weights(self, given: Mapping[str, float]) -> torch.Tensor:
        for name, weight in given.items():
            if weight < 0:
                raise ConfigError(f"modality_weights.{name} must be >= 0, got {weight}")
        weights = torch.tensor([float(given.get(m, 1.0)) for m in self.modalities], dtype=torch.float64)
        if weights.sum() <= 0:
            raise ConfigError(f"modality_weights give every modality present ({', '.join(self.modalities)}) "
                              "weight 0; give at least one a positive weight")
        return weights

    def _draw(self, step: int) -> int:
        while len(self._draws) <= step:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + len(self._draws))
            self._draws.append(int(torch.multinomial(self.weights, 1, generator=generator)))
        return self._draws[step]

    def modality(self, step: int) -> str:
        """The modality of training batch `step`."""
        return self.modalities[self._draw(step)]

    def batch(self, step: int) -> list[int]:
        """Row indices of training batch `step`, all of one modality."""
        drawn = self._draw(step)
        rows = self.groups[self.modalities[drawn]]
        used = sum(1 for d in self._draws[:step] if d == drawn) * self.batch_size  # rows of it before
        out = []
        for position in range(used, used + self.batch_size):
            epoch, offset = divmod(position, len(rows))
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 31 + drawn)
            out.append(rows[int(torch.randperm(len(rows), generator=generator)[offset])])
        return out


def validation_batches(modalities: Sequence[str], batch_size: int) -> list[list[int]]:
    """Every row once, in single-modality batches: modalities in sorted order, rows in order."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    return [rows[start:start + batch_size]
            for rows in _group(modalities).values() for start in range(0, len(rows), batch_size)]
