"""Write the VeRL-Omni catalog (omni_core/backends/verl_omni/catalog/*.json) and the test fact table
(tests/data/verl_omni_recipes.json) from the pinned recipe scripts kept verbatim under
tests/data/verl_omni/scripts/ (copied from verl-project/verl-omni at VERL_OMNI_COMMIT with
`git show COMMIT:PATH`). The per-recipe facts a script does not state (model, algorithm, modalities,
the hardware it was published on, the dataset layout) are below, read from the scripts' headers and
the examples' READMEs at the same commit.

    python scripts/gen_verl_omni_catalog.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omni_core.backends.verl_omni.catalog import VERL_OMNI_COMMIT
from omni_core.backends.verl_omni.render import ENV_DROP, OPTION_KEYS, split_override
from omni_core.backends.verl_omni.render import infer_substitutions as substitutions
from omni_core.backends.verl_omni.script import parse_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests/data/verl_omni/scripts"
CATALOG = ROOT / "omni_core/backends/verl_omni/catalog"
FACTS = ROOT / "tests/data/verl_omni_recipes.json"

GSPO_LAYOUT = "{train,test}.parquet: prompt (chat messages), data_source, reward_model.ground_truth"
OCR_QI = ("{train,test}.parquet: prompt = [system, user] (Qwen-Image form), negative_prompt, "
          "reward_model.ground_truth (the text to render); data_process/qwenimage_ocr.py")
OCR_SD3 = ("{train,test}.parquet: prompt = [user] (SD3 form), extra_info.raw_prompt, reward_model.ground_truth; "
           "data_process/sd3_ocr.py")
META = {
    "qwen3_omni_gspo": [
        dict(name="qwen3-omni-thinker-gspo-gsm8k", script="examples/gspo_trainer/qwen3_omni/run_qwen3_omni_thinker_gspo_lora_v1.sh",
             model="Qwen/Qwen3-Omni-30B-A3B-Instruct", algorithm="GSPO", modalities="text -> text",
             published="4x H800 80GB (examples/gspo_trainer/README.md)", device="gpu", dataset="gsm8k",
             data_layout=GSPO_LAYOUT + " (verl's gsm8k preprocessing)"),
        dict(name="qwen3-omni-thinker-gspo-mmk12", script="examples/gspo_trainer/qwen3_omni/run_qwen3_omni_thinker_gspo_lora_mmk12_v1.sh",
             model="Qwen/Qwen3-Omni-30B-A3B-Instruct", algorithm="GSPO", modalities="text+image -> text",
             published="4x H800 80GB (examples/gspo_trainer/README.md)", device="gpu", dataset="mmk12",
             data_layout=GSPO_LAYOUT + ", images (bytes inline); data_process/mmk12.py"),
        dict(name="qwen3-omni-thinker-gspo-mmk12-npu", script="examples/gspo_trainer/qwen3_omni/run_qwen3_omni_thinker_gspo_lora_mmk12_v1_npu.sh",
             model="Qwen/Qwen3-Omni-30B-A3B-Instruct", algorithm="GSPO", modalities="text+image -> text",
             published="Ascend NPU, 16 per node (trainer.n_gpus_per_node in the script)", device="npu", dataset="mmk12",
             data_layout=GSPO_LAYOUT + ", images (bytes inline); data_process/mmk12.py"),
        dict(name="qwen3-omni-thinker-gspo-avqa-npu", script="examples/gspo_trainer/qwen3_omni/run_qwen3_omni_thinker_gspo_npu_avqa_v1.sh",
             model="Qwen/Qwen3-Omni-30B-A3B-Instruct", algorithm="GSPO", modalities="text+image+audio -> text",
             published="Atlas 800T A3 (16x Ascend 910C 64GB)", device="npu", dataset="avqa",
             data_layout=("{train,validation}.parquet read by QwenOmniRLHFDataset: prompt, images/audios as file "
                          "paths outside the Parquet (absolute), reward_model.ground_truth; data_process/avqa.py")),
    ],
    "qwen3_omni_dpo": [
        dict(name="qwen3-omni-dpo-omni-preference", script="examples/dpo_trainer/qwen3_omni/qwen3_omni/run_qwen3_omni_omni_preference_lora.sh",
             model="Qwen/Qwen3-Omni-30B-A3B-Instruct", algorithm="DPO", modalities="text+image/video/audio -> text",
             published="4 GPUs (CUDA_VISIBLE_DEVICES=4,5,6,7 in the script)", device="gpu", dataset="omni_preference",
             data_layout=("{image,video,audio}/{train,test}.parquet: prompt, chosen, rejected, media paths; "
                          "data_process/prepare_offline_dpo.py (modality-grouped batches)")),
    ],
    "qwen_image_flowgrpo": [
        dict(name="qwen-image-flowgrpo-ocr-lora", script="examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh",
             model="Qwen/Qwen-Image", algorithm="FlowGRPO", modalities="text -> image",
             published="4 GPUs (examples/flowgrpo_trainer/README.md)", device="gpu", dataset="ocr", data_layout=OCR_QI),
        dict(name="qwen-image-flowgrpo-ocr-full", script="examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr.sh",
             model="Qwen/Qwen-Image", algorithm="FlowGRPO", modalities="text -> image",
             published="4 GPUs x 1 node (NUM_GPUS/NUM_NODES defaults)", device="gpu", dataset="ocr", data_layout=OCR_QI),
        dict(name="qwen-image-edit-flowgrpo-pickscore-lora", script="examples/flowgrpo_trainer/qwen_image_edit/run_qwen_image_edit_lora.sh",
             model="Qwen/Qwen-Image-Edit-2511", algorithm="FlowGRPO", modalities="text+image -> image",
             published="8 GPUs (NUM_GPUS_ACTOR_ROLLOUT_REWARD default)", device="gpu", dataset="image_edit",
             data_layout="{train,test}.parquet: prompt, source image; flowgrpo_trainer/qwen_image_edit/prepare_data.py"),
    ],
    "sd35_flowgrpo": [
        dict(name="sd35-medium-flowgrpo-ocr-lora-v1", script="examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora_v1.sh",
             model="stabilityai/stable-diffusion-3.5-medium", algorithm="FlowGRPO", modalities="text -> image",
             published="3 GPUs (2 actor+rollout, 1 reward)", device="gpu", dataset="ocr", data_layout=OCR_SD3),
        dict(name="sd35-medium-flowgrpo-ocr-lora-v1-separate-async", script="examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora_v1_separate_async.sh",
             model="stabilityai/stable-diffusion-3.5-medium", algorithm="FlowGRPO", modalities="text -> image",
             published="5 GPUs (2 actor, 2 standalone rollout, 1 reward)", device="gpu", dataset="ocr", data_layout=OCR_SD3),
        dict(name="sd35-medium-flowgrpo-drm-lora", script="examples/flowgrpo_trainer/sd35/run_sd35_medium_drm_lora.sh",
             model="stabilityai/stable-diffusion-3.5-medium", algorithm="FlowGRPO", modalities="text -> image",
             published="8 GPUs (7 training, 1 DiNa-LRM server)", device="gpu", dataset="pickscore_sfw",
             data_layout="{train,test}.parquet: SD3-form prompts; data_process/sd3_pickscore_sfw.py"),
    ],
    "ltx2_flowgrpo": [
        dict(name="ltx2.3-flowgrpo-t2av-lora", script="examples/flowgrpo_trainer/ltx2/run_ltx2_3_t2av_lora.sh",
             model="dg845/LTX-2.3-Diffusers", algorithm="FlowGRPO", modalities="text -> video+audio",
             published="8 GPUs (examples/flowgrpo_trainer/ltx2/README.md)", device="gpu", dataset="vid_prompt",
             data_layout="{train,test}.parquet: text prompts; flowgrpo_trainer/ltx2/prepare_data.py"),
    ],
    "bagel_flowgrpo": [
        dict(name="bagel-flowgrpo-ocr-lora", script="examples/flowgrpo_trainer/bagel/run_bagel_ocr_lora.sh",
             model="ByteDance-Seed/BAGEL-7B-MoT", algorithm="FlowGRPO", modalities="text -> image",
             published="4 GPUs (examples/flowgrpo_trainer/bagel/README.md)", device="gpu", dataset="ocr",
             data_layout="{train,test}.parquet: OCR prompts in BAGEL's form; data_process/bagel_ocr.py"),
    ],
    "flowdppo": [
        dict(name="qwen-image-flowdppo-ocr-lora", script="examples/flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh",
             model="Qwen/Qwen-Image", algorithm="Flow-DPPO", modalities="text -> image",
             published="4 GPUs (examples/flowdppo_trainer/README.md)", device="gpu", dataset="ocr", data_layout=OCR_QI),
    ],
    "wan22_dancegrpo": [
        dict(name="wan2.2-dancegrpo-t2v-hpsv3", script="examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh",
             model="Wan-AI/Wan2.2-TI2V-5B-Diffusers", algorithm="DanceGRPO", modalities="text -> video",
             published="8 GPUs (16 NPUs on Ascend; the GPU branch is read)", device="gpu", dataset="hpsv3",
             data_layout="{train,test}.parquet: text prompts; dancegrpo_trainer/data_process/wan22_hpsv3.py"),
    ],
}
def example(base: list[str], algorithm: str) -> dict[str, object]:
    values = {key: value for _, key, value in map(split_override, base)}
    out: dict[str, object] = {"algorithm": algorithm}
    for option, keys in OPTION_KEYS.items():
        for key in keys:
            if key in values:
                out[option] = _typed(values[key])
                break
    return out


def _typed(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main() -> None:
    facts = {"repo": "verl-project/verl-omni", "commit": VERL_OMNI_COMMIT, "scripts": []}
    for family, items in META.items():
        out = []
        for meta in items:
            text = (SCRIPTS / meta["script"]).read_text()
            cmd = parse_script(text, meta["script"])
            facts["scripts"].append({"recipe": meta["name"], "path": meta["script"],
                                     "sha256": hashlib.sha256(text.encode()).hexdigest(), "python": cmd.python,
                                     "module": cmd.module, "env": cmd.env, "overrides": cmd.overrides})
            drop = [k for k in cmd.env if k in ENV_DROP]
            ex = example(cmd.overrides, meta["algorithm"])
            if "${" in cmd.env.get("custom_reward_model_path", ""):
                ex["env"] = {"custom_reward_model_path": "/shared/models/HPSv3/HPSv3.safetensors"}
            out.append({**meta, "python": cmd.python, "module": cmd.module, "env": cmd.env, "base": cmd.overrides,
                        "substitutions": substitutions(cmd.overrides), "env_drop": drop, "example": ex,
                        "notes": [f"env {k} not set: {ENV_DROP[k]}" for k in drop]})
        (CATALOG / f"{family}.json").write_text(json.dumps({"family": family, "commit": VERL_OMNI_COMMIT,
                                                            "recipes": out}, indent=1) + "\n")
    FACTS.write_text(json.dumps(facts, indent=1) + "\n")


if __name__ == "__main__":
    main()
