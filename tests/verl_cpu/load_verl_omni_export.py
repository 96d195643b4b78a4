"""Run by the verl environment's python: load VeRL-Omni recipe exports through verl 0.9.1's
RLHFDataset (configured by verl's own ppo_trainer data section), and print one JSON line per file set.

argv: MODEL_DIR FILES_JSON (a list of [label, [files...], processor: bool])
"""

import json
import os
import sys


def main() -> None:
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils import hf_processor, hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    model, sets = sys.argv[1], json.loads(sys.argv[2])
    tokenizer = hf_tokenizer(model)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    out = {}
    for label, files, use_processor in sets:
        processor = hf_processor(model) if use_processor else None
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            ppo = compose("ppo_trainer", overrides=[f"data.train_files={json.dumps(files)}",
                                                    "data.max_prompt_length=1024"])
        rl = RLHFDataset(data_files=list(ppo.data.train_files), tokenizer=tokenizer, config=ppo.data,
                         processor=processor)
        item = rl[0]
        out[label] = {"rows": len(rl), "keys": sorted(item), "data_source": item.get("data_source"),
                      "ground_truth": (item.get("reward_model") or {}).get("ground_truth"),
                      "raw_prompt": item.get("raw_prompt"),
                      "prompt_token_ids": [int(t) for t in item["prompt_token_ids"]] if "prompt_token_ids" in item else None}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
