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

# the backend's own seconds per stage (rank 0's, logged once at the end; `trl/start_s` and
# `trl/driver_import_s` by the driver),
# beside TRL's own per-step names (whatever its trainer logs: `reward`, `rewards/{function}/mean`, `loss`, ...)
OWN_SECONDS = {
    "driver_import": "the driver's import of Ray Train (once per process: 0 for its later trl stages)",
    "start": "from Ray Train's fit() to the workers' train function (controller and worker processes, imports)",
    "setup": "the worker's set-up: TRL's import, the model, the data mapping and TRL's trainer",
    "data": "the dataset version mapped to TRL's columns (part of setup)",
    "restore": "the store's checkpoint copied back for a resumed run",
    "checkpoint": "TRL's checkpoint-N folders committed to the store",
    "final_commit": "the final model committed as our checkpoint",
}
DRIVER_SECONDS = ("driver_import", "start")  # logged by the driver, the rest by the workers' rank 0
OWN_METRICS = {STEP_METRIC: "wall seconds of TRL's step (its trainer's on_step_begin to on_step_end, rank 0)",
               **{f"trl/{name}_s": text for name, text in OWN_SECONDS.items()}}
