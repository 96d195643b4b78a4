"""Scoring a language model (a causal LM or a Qwen3-Omni thinker) on prompt rows: `n` responses per row
from our rollout engine (`ARengine`), scored by the rows' rewards, verl's validation names.

The engine runs request-level batches of `batch_size` prompts x `n` responses in row order (the
scheduler thread stays idle), so a run's numbers never depend on timing: each forward's composition is
the same on every run. Response j of row i is drawn with `rollout_seed(seed, 0, i, j)`: a response
depends on its row, the seed and the weights only, so a candidate and its baseline are compared on the
same random numbers. Greedy is argmax, as in HF `generate`.

Text-only Qwen3 causal LMs take a faster loop over the same batches (`omni_core.rollout.lean_decode`:
the engine's prefill and token rule, the decode steps without transformers' per-token overhead) with
the same responses.

With `engine: vllm_omni` the responses come from vLLM-Omni's AsyncOmni instead (GPU images: the `gpu`
extra): the checkpoint folder is its model (a LoRA checkpoint: its base, with the adapter pushed as a
LoRA request), the same requests and seeds (vLLM's own sampler: sampled draws differ from ours, greedy
is argmax in both); the model's weights are never loaded into torch here. Text prompts only (vLLM-Omni
takes raw media, our rows' media go through the processor).
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError
from omni_core.evaluation.job import EvalJob


def sampling_of(settings: dict[str, Any]) -> Any:
    from omni_core.training.components import Sampling

    return Sampling(temperature=settings["temperature"], top_p=settings["top_p"],
                    max_new_tokens=settings["max_new_tokens"], greedy=settings["greedy"])


def generate_responses(model: Any, text_io: Any, rows: list[dict[str, Any]], settings: dict[str, Any],
                       seed: int) -> list[str]:
    """The `n` responses of each row (response j of row i at i * n + j): by `lean_responses` for the
    models `lean_decode` covers (text-only Qwen3 causal LMs), else by `engine_responses`; the two give
    the same responses."""
    from omni_core.rollout import lean_decode

    if lean_decode.supports(model, text_io):
        return lean_responses(model, text_io, rows, settings, seed)
    return engine_responses(model, text_io, rows, settings, seed)


def engine_responses(model: Any, text_io: Any, rows: list[dict[str, Any]], settings: dict[str, Any],
                     seed: int) -> list[str]:
    """`generate_responses` from an `ARengine` (any causal LM, the Qwen3-Omni thinker with media)."""
    from omni_core.rollout.autoregressive import ARengine
    from omni_core.rollout.engine import EngineConfig
    from omni_core.training.components import encode_prompt_inputs, rollout_requests, rollout_seed

    n, size = settings["n"], settings["batch_size"]
    sampling = sampling_of(settings)
    engine = ARengine(model, text_io, EngineConfig(max_num_seqs=size * n))
    texts: list[str] = []
    try:
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            prompts, media = encode_prompt_inputs(text_io, chunk, settings["max_prompt_tokens"])
            seeds = [rollout_seed(seed, 0, start + i, j) for i in range(len(chunk)) for j in range(n)]
            requests = rollout_requests(prompts, n=n, sampling=sampling, seeds=seeds, media=media)
            with engine._lock:  # request-level, in order: see the module docstring
                texts += [r.text for r in engine.run_requests(requests)]
    finally:
        engine.close()
    return texts


def lean_responses(model: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: dict[str, Any],
                   seed: int) -> list[str]:
    """`generate_responses` by `lean_decode.decode`: the engine's batches, seeds, stop and pad tokens."""
    from omni_core.rollout import lean_decode
    from omni_core.training.components import rollout_seed

    n, size = settings["n"], settings["batch_size"]
    sampling = sampling_of(settings)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    texts: list[str] = []
    for start in range(0, len(rows), size):
        prompts = encode_batch(tokenizer, rows[start:start + size], settings["max_prompt_tokens"])
        seeds = [rollout_seed(seed, 0, start + i, j) for i in range(len(prompts)) for j in range(n)]
        outputs = lean_decode.decode(model, [p for p in prompts for _ in range(n)], sampling, seeds, [eos], pad)
        texts += tokenizer.batch_decode(outputs, skip_special_tokens=True)
    return texts


def encode_batch(tokenizer: Any, rows: list[dict[str, Any]], max_prompt_tokens: int) -> list[list[int]]:
    """`training.components.encode_prompts`'s token ids, the rows' chat templates applied in one call: the
    tokenizer then encodes them as one batch, in about half the time of a call per row."""
    ids = tokenizer.apply_chat_template([list(row["prompt"]) for row in rows], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return [list(row_ids)[-max_prompt_tokens:] for row_ids in ids]


VLLM_OMNI = "vllm_omni"


def vllm_omni_responses(job: EvalJob, text_io: Any, api: Any = None) -> list[str]:
    """The `n` responses of each row from vLLM-Omni (module docstring), in the order of `generate_responses`.
    `api` replaces the vLLM-Omni classes (tests)."""
    from omni_core.models.factory import model_source
    from omni_core.rollout.engine import EngineConfig
    from omni_core.rollout.vllm_omni import VllmOmniEngine
    from omni_core.training.components import encode_prompt_inputs, rollout_requests, rollout_seed

    settings, spec = job.settings, job.candidate
    n, size = settings["n"], settings["batch_size"]
    engine = VllmOmniEngine(str(model_source(spec.uri, spec.seed)), EngineConfig(max_num_seqs=size * n),
                            output_mode="ar", lora=spec.lora if spec.adapter_key else None, api=api)
    texts: list[str] = []
    try:
        if spec.adapter_key:
            from safetensors.torch import load as load_safetensors

            engine.update_weights(load_safetensors(job.store.read_bytes(spec.adapter_key)), 1)
        for start in range(0, len(job.rows), size):
            chunk = job.rows[start:start + size]
            prompts, media = encode_prompt_inputs(text_io, chunk, settings["max_prompt_tokens"])
            if media is not None and any(media):
                raise ConfigError("eval engine vllm_omni: these rows carry images or audio, which vLLM-Omni takes "
                                  "raw; score them with engine: native")
            seeds = [rollout_seed(job.seed, 0, start + i, j) for i in range(len(chunk)) for j in range(n)]
            requests = rollout_requests(prompts, n=n, sampling=sampling_of(settings), seeds=seeds)
            texts += [r.text or "" for r in engine.generate(requests)]
    finally:
        engine.close()
    return texts


def score_text(job: EvalJob, model: Any, text_io: Any) -> dict[str, Any]:
    from omni_core.training.components import score_rollouts, val_metrics

    n = job.settings["n"]
    if job.settings.get("engine") == VLLM_OMNI:
        texts = vllm_omni_responses(job, text_io)
    else:
        texts = generate_responses(model, text_io, job.rows, job.settings, job.seed)
    scores = [float(s["score"]) for s in score_rollouts(job.rows, texts, job.reward, n)]
    records = [{"row": i // n, "response": text, "score": score}
               for i, (text, score) in enumerate(zip(texts, scores, strict=True))]
    metrics = val_metrics([{"row": job.rows[r["row"]], "score": r["score"]} for r in records], n)
    return {"metrics": metrics, "records": records}
