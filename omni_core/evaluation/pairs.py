"""Scoring a preference model (dpo, mpo) on held-out chosen/rejected pairs against its reference, with
TRL's evaluation names:

- `eval_rewards/chosen`, `eval_rewards/rejected`: mean implicit reward beta * (log pi - log ref) of the
  chosen / rejected response;
- `eval_rewards/accuracies`: share of pairs whose chosen reward beats the rejected one;
- `eval_rewards/margins`: mean chosen - rejected reward;
- `eval_logps/chosen`, `eval_logps/rejected`: mean sequence log-prob under the model;
- `eval_loss`: the stage's own preference loss (sigmoid for dpo, the mpo mix).

Each also per modality where the pairs carry one: `eval_rewards/accuracies/image`, ... The reference is
the trained stage's starting model (a LoRA checkpoint: the base, its adapter disabled). Batches hold
one modality (as in training), `batch_size` pairs each; everything is deterministic (no sampling).
"""

from __future__ import annotations

from typing import Any

from omni_core.evaluation.job import EvalJob

NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected", "loss")


def score_pairs(job: EvalJob, model: Any, text_io: Any, reference: Any) -> dict[str, Any]:
    import torch

    from omni_core.training.preference import (
        PreferenceConfig,
        WeightedMeans,
        encode_pairs,
        pair_logps,
        preference_step_loss,
        reference_logps,
    )
    from omni_core.training.sampler import row_modality, validation_batches

    config = PreferenceConfig(**job.sampler["options"])
    beta, average = config.beta, config.average_log_prob
    rows = job.rows
    means = WeightedMeans(NAMES)
    records: list[dict[str, Any]] = []
    with torch.no_grad():
        for index in validation_batches([row_modality(r) for r in rows], job.settings["batch_size"]):
            batch = encode_pairs(text_io, [rows[i] for i in index])
            policy = pair_logps(model, batch, average)
            ref = reference_logps(model, reference, batch, average)
            loss, _ = preference_step_loss(policy, ref, config, "")
            chosen, rejected = beta * (policy.chosen - ref.chosen), beta * (policy.rejected - ref.rejected)
            metrics = {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
                       "rewards/accuracies": (chosen > rejected).float().mean().item(),
                       "rewards/margins": (chosen - rejected).mean().item(),
                       "logps/chosen": policy.chosen.mean().item(), "logps/rejected": policy.rejected.mean().item(),
                       "loss": float(loss)}
            means.update(metrics, batch.num_pairs, batch.modalities[0])
            records += [{"row": i, "chosen_reward": float(c), "rejected_reward": float(r),
                         "score": float(c > r), "modality": batch.modalities[0]}
                        for i, c, r in zip(index, chosen.tolist(), rejected.tolist(), strict=True)]
    records.sort(key=lambda r: r["row"])
    return {"metrics": trl_names(means), "records": records}


def trl_names(means: Any) -> dict[str, float]:
    """`eval_{name}` over every pair and `eval_{name}/{modality}` per modality."""
    out = {}
    for group in sorted(means.sums):
        count = means.counts[group]
        for name, total in means.sums[group].items():
            out[f"eval_{name}" + (f"/{group}" if group else "")] = total / count
    return out
