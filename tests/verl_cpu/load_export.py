"""Run by the verl environment's python: load exported files through verl 0.9.1's own dataset classes,
configured by verl's own Hydra config (the data sections main_ppo and sft_trainer compose), and print
one JSON line describing what verl read.

argv: MODEL_DIR RL_FILES_JSON SFT_FILES_JSON
"""

import json
import os
import sys


def main() -> None:
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.sft_trainer import create_sft_dataset
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    model, rl_files, sft_files = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    tokenizer = hf_tokenizer(model)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        ppo = compose("ppo_trainer", overrides=[f"data.train_files={json.dumps(rl_files)}", "data.max_prompt_length=256"])
        sft = compose("sft_trainer_engine", overrides=[f"data.train_files={json.dumps(sft_files)}",
                                                       "data.max_length=512", "data.pad_mode=right",
                                                       "data.truncation=right"])
    rl = RLHFDataset(data_files=list(ppo.data.train_files), tokenizer=tokenizer, config=ppo.data)
    item = rl[0]
    sft_set = create_sft_dataset(list(sft.data.train_files), sft.data, tokenizer, None)
    sft_item = sft_set[0]
    loss_mask = sft_item["loss_mask"]
    print(json.dumps({
        "rl_rows": len(rl), "rl_keys": sorted(item), "rl_data_source": item.get("data_source"),
        "rl_ground_truth": item["reward_model"]["ground_truth"], "rl_raw_prompt": item.get("raw_prompt"),
        "sft_rows": len(sft_set), "sft_messages": sft_set.messages[0],
        "sft_trained_tokens": int(loss_mask.sum()), "sft_tokens": int(sft_item["attention_mask"].sum()),
        "sft_trained_text": tokenizer.decode(sft_item["input_ids"][loss_mask.bool()].tolist()),
    }, default=str))


if __name__ == "__main__":
    main()
