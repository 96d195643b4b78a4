"""The metric names a trl stage logs and shows: TRL's own, plus our step time."""

from __future__ import annotations

STEP_METRIC = "timing_s/step"  # our trainers' name for a step's wall time: the driver's progress follows it
SUMMARY_KEYS = frozenset({"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                          "train_loss"})  # the end-of-training summary transformers logs (not a step's)
# the headline metrics of a step's progress line (TRL's names, with short labels), by TRL trainer
PROGRESS = {"GRPOTrainer": (("reward", "reward"), ("reward_std", "reward_std"), ("kl", "kl"),
                            ("completions/mean_length", "len")),
            "DPOTrainer": (("loss", "loss"), ("rewards/accuracies", "reward_acc"), ("rewards/margins", "margin")),
            "SFTTrainer": (("loss", "loss"), ("mean_token_accuracy", "token_acc"))}
