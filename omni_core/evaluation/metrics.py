"""The metric names an eval stage logs, by eval kind (the docs' metric reference is generated from
these; the scorers in text.py, images.py and pairs.py log them). `{data_source}` and `{n}` stand for a
row's data source and the responses per prompt; MLflow spells `@` as `_at_` (as verl's logger does)."""

from __future__ import annotations

REWARD_METRICS = {
    "val/reward_mean": "mean score over every row and response (image) of the split",
    "val-core/{data_source}/reward/mean@{n}": "mean score of the rows of one data source, n responses (images) a row",
}

PAIR_METRICS = {
    "eval_rewards/chosen": "mean implicit reward beta * (log pi - log ref) of the chosen responses",
    "eval_rewards/rejected": "the same, of the rejected responses",
    "eval_rewards/accuracies": "share of pairs whose chosen reward beats the rejected one",
    "eval_rewards/margins": "mean chosen - rejected reward",
    "eval_logps/chosen": "mean sequence log-prob of the chosen responses under the model",
    "eval_logps/rejected": "the same, of the rejected responses",
    "eval_loss": "the trained stage's own preference loss (sigmoid for dpo, the mpo mix)",
    "eval_{name}/{modality}": "each of the above per modality where the pairs carry one, e.g. "
                              "eval_rewards/accuracies/image",
}

TRAINER_METRICS = {
    "val-core/{data_source}/{var}/mean@{n}": "verl's own validation (engine: trainer): var is reward and every key "
                                             "of the reward's extra info (acc, ...); with n > 1 also std@n, best@k, "
                                             "worst@k, maj@k",
    "val-aux/{data_source}/{var}/mean@{n}": "verl's auxiliary validation metrics, the same forms",
    "val/reward_mean": "the mean over data sources of reward/mean@n (a DPO recipe's validation has none: "
                       "val/reward_accuracy and the other pair metrics instead)",
}

# kind -> (title, metrics); the kinds are omni_core.evaluation.job's, plus a verl stage's own validation
EVAL_KINDS: dict[str, tuple[str, dict[str, str]]] = {
    "text": ("Language models", REWARD_METRICS),
    "images": ("Diffusion models", {**REWARD_METRICS, "eval_grid.png": "an artifact, not a metric: the first "
                                                                       "`samples` images with their scores"}),
    "pairs": ("Preference models", PAIR_METRICS),
    "trainer": ("A verl or VeRL-Omni stage's own validation", TRAINER_METRICS),
}

EVAL_METRIC_NOTES = (
    "`baseline: true`: every metric again for the trained stage's starting model on the same rows and seeds as "
    "`{metric}_baseline`, and `{metric}_gain` = candidate - baseline.",
    "The first `samples` rows are the table `eval_samples.json` (prompt, response or chosen/rejected, ground truth, "
    "score; the baseline's beside them), an artifact of the eval run.",
)
