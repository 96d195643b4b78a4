"""The diffusion rollout engine: FlowGRPO SDE sampling of a text-to-image rectified-flow model (`SD3Model`).

One implementation of the sampling math, used three ways:

- `denoise_step`: one denoising step of a batch whose samples may sit at different noise levels
  (per-sample sigmas, the transformer takes a per-sample timestep): one transformer forward, True-CFG
  over [negative; prompt] in that same forward (2B rows), then the FlowGRPO SDE step
  (`flow_sde_step`, docs/reference/formulas.md#flowgrpo) or the Euler ODE step when noise_level is 0;
- `sample_trajectories`: whole trajectories of a batch, one `denoise_step` per denoising step (the
  trainer's `omni_core.training.flow_grpo.rollout` and the engine's request-level batches);
- `DiffusionEngine`: the `RolloutEngine` over them. Request-level batching packs whole compatible
  requests into one forward per step; step-level batching advances the running requests by one step
  per forward, whatever step each is at, and admits new ones as others finish.

Randomness: each sample draws its initial noise and then each SDE step's noise from its own CPU
`torch.Generator` seeded with the request's seed, in that order, so a sample is the same alone, in any
batch and in either scheduling mode (up to float rounding of batched matmuls, ~1e-7).

A result carries `output` = the final image [C, H, W] in [-1, 1], `logprobs` = the per-step
log-probs [num_steps] (float32; nan for an ODE request), and in `extra` what a trainer needs to
recompute them: `latents` [S + 1, C, H, W] (before step j at j, after it at j + 1), `sigmas` [S + 1],
`means` [S, C, H, W], `sampling` (the resolved `DiffusionSampling`) and, unless the engine was built
with return_prompt_embeds=False, the prompt's `prompt_embeds` [L, D] / `pooled_prompt_embeds` [P] and,
with True-CFG, the negative prompt's `negative_prompt_embeds` / `negative_pooled_prompt_embeds`.
`omni_core.training.flow_grpo.DiffusionRollout.from_results` stacks results into a trainer batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omni_core.algorithms.flow_grpo import SDE_TYPES, flow_sde_step, per_sample
from omni_core.errors import ConfigError
from omni_core.models.diffusion import PromptEmbeds, SD3Model
from omni_core.rollout.engine import EngineConfig, RolloutEngine, RolloutRequest, RolloutResult

__all__ = ["DiffusionEngine", "DiffusionSampling", "Trajectories", "denoise_step", "sample_trajectories"]


@dataclass(frozen=True)
class DiffusionSampling:
    """Sampling parameters of one image. noise_level 0 is the deterministic ODE sampler (no log-probs);
    guidance_scale != 1 turns True-CFG on with `negative_prompt` as the unconditional branch;
    height / width default to the model's sample size."""

    num_steps: int = 10
    guidance_scale: float = 1.0
    noise_level: float = 0.7
    sde_type: str = "sde"
    negative_prompt: str = ""
    height: int | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ConfigError(f"diffusion sampling num_steps={self.num_steps}: must be at least 1")
        if not (math.isfinite(self.noise_level) and self.noise_level >= 0):
            raise ConfigError(f"diffusion sampling noise_level={self.noise_level}: must be >= 0 (0: ODE)")
        if not math.isfinite(self.guidance_scale):
            raise ConfigError(f"diffusion sampling guidance_scale={self.guidance_scale}: must be finite")
        if self.sde_type not in SDE_TYPES:
            raise ConfigError(f"diffusion sampling sde_type={self.sde_type!r}: use one of {', '.join(SDE_TYPES)}")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"diffusion sampling {name}={value}: must be positive")

    @property
    def cfg(self) -> bool:
        return self.guidance_scale != 1.0

    def resolved(self, model: SD3Model) -> DiffusionSampling:
        """With the model's default size filled in."""
        return dataclasses.replace(self, height=self.height or model.sample_size, width=self.width or model.sample_size)

    def shape(self, model: SD3Model) -> tuple[int, int, int]:
        """The sample's shape [C, H, W] (pixel space: the image's)."""
        return (model.channels, self.height or model.sample_size, self.width or model.sample_size)


# ---- the sampling math (shared with omni_core.training.flow_grpo.rollout) ------------------------


def draw_noise(generators: Sequence[torch.Generator], shape: Sequence[int], device: torch.device,
               out: Tensor | None = None) -> Tensor:
    """[len(generators), *shape] standard normal, row i from generators[i] (CPU generators: the numbers
    do not depend on the device)."""
    if out is None:
        out = torch.empty((len(generators), *shape), dtype=torch.float32)
    for row, generator in zip(out, generators, strict=True):
        torch.randn(tuple(shape), generator=generator, dtype=torch.float32, out=row)
    return out.to(device)


def denoise_step(
    model: SD3Model,
    x: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    cond: PromptEmbeds,
    uncond: PromptEmbeds | None,
    sampling: DiffusionSampling,
    generators: Sequence[torch.Generator],
    noise_buffer: Tensor | None = None,
    inference_kernels: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One denoising step of the batch x [B, C, H, W] from noise level `sigma` to `sigma_next` (scalars
    or one per sample): (x_next, log_prob [B], mean). One transformer forward (True-CFG: [uncond; cond]
    in it when sampling.guidance_scale != 1); SDE noise from `generators[i]` for sample i. With
    noise_level 0 it is the Euler ODE step, log_prob nan and no noise drawn. `inference_kernels`: see
    `SD3Model.velocity` (the engine's forwards; equal to the plain forward up to float rounding)."""
    v = model.velocity(x, sigma, cond, uncond=uncond if sampling.cfg else None,
                       guidance_scale=sampling.guidance_scale, inference_kernels=inference_kernels)
    if sampling.noise_level > 0:
        noise = draw_noise(generators, x.shape[1:], x.device, out=noise_buffer)
        x_next, log_prob, mean, _ = flow_sde_step(
            x, v, sigma, sigma_next, sampling.noise_level, noise=noise, sde_type=sampling.sde_type,  # type: ignore[arg-type]
        )
        return x_next, log_prob, mean
    x_next = x.float() + (per_sample(sigma_next, x) - per_sample(sigma, x)) * v.float()
    return x_next, torch.full((x.shape[0],), float("nan"), device=x.device), x_next


@dataclass
class Trajectories:
    """Sampled trajectories of a batch: `latents` [B, S + 1, C, H, W] (before step j at [:, j], after
    it at [:, j + 1]), `log_probs` [B, S], `means` [B, S, C, H, W], `sigmas` [S + 1] from 1 to 0."""

    latents: Tensor
    log_probs: Tensor
    means: Tensor
    sigmas: Tensor

    @property
    def images(self) -> Tensor:
        return self.latents[:, -1].clamp(-1, 1)


@torch.no_grad()
def sample_trajectories(
    model: SD3Model,
    cond: PromptEmbeds,
    uncond: PromptEmbeds | None,
    seeds: Sequence[int],
    sampling: DiffusionSampling,
    sigmas: Tensor | None = None,
    inference_kernels: bool = False,
) -> Trajectories:
    """Sample one trajectory per row of `cond` with noise seed `seeds[i]`: the initial noise, then
    `sampling.num_steps` `denoise_step`s of the whole batch (one forward each; `inference_kernels`:
    see `denoise_step`)."""
    if len(cond) != len(seeds):
        raise ValueError(f"{len(cond)} prompt embeddings but {len(seeds)} seeds")
    device = model.device
    batch, steps, shape = len(seeds), sampling.num_steps, sampling.shape(model)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    if sigmas is None:
        sigmas = model.sigmas(steps)
    sigmas = sigmas.to(device)
    latents = torch.empty((batch, steps + 1, *shape), dtype=torch.float32, device=device)
    means = torch.empty((batch, steps, *shape), dtype=torch.float32, device=device)
    log_probs = torch.empty((batch, steps), dtype=torch.float32, device=device)
    noise_buffer = torch.empty((batch, *shape), dtype=torch.float32)
    x = draw_noise(generators, shape, device, out=noise_buffer).clone()
    latents[:, 0] = x
    for j in range(steps):
        x, log_probs[:, j], means[:, j] = denoise_step(
            model, x, sigmas[j], sigmas[j + 1], cond, uncond, sampling, generators, noise_buffer, inference_kernels
        )
        latents[:, j + 1] = x
    return Trajectories(latents=latents, log_probs=log_probs, means=means, sigmas=sigmas)


# ---- the engine ----------------------------------------------------------------------------------


@dataclass
class _State:
    """A running request (step-level): its trajectory so far."""

    sampling: DiffusionSampling
    generator: torch.Generator
    cond: PromptEmbeds  # [1, ...]
    uncond: PromptEmbeds | None
    sigmas: Tensor  # [S + 1]
    latents: Tensor  # [S + 1, C, H, W]
    log_probs: Tensor  # [S]
    means: Tensor  # [S, C, H, W]
    j: int = 0  # steps taken


class DiffusionEngine(RolloutEngine):
    """Rollouts of `model` (`SD3Model`) for `RolloutRequest(prompt=<text>, sampling=DiffusionSampling(...),
    seed)`. Compatible requests share size, steps, guidance, noise level and SDE type (the negative
    prompt may differ: it is per-sample conditioning). Prompt encodings are cached (LRU,
    `prompt_cache_size` texts): a FlowGRPO group shares its prompt, every request its negative prompt.
    `load_weights` takes transformer state-dict entries (all of them, or only the LoRA adapter's).
    `inference_kernels` (default on): forwards through `omni_core.models.diffusion.sd3_inference_forward`
    (same modules and math in fewer passes; equal to the plain forward up to float rounding, ~1e-7);
    False runs the plain diffusers forward. `stats["forwards"]` counts transformer forwards."""

    def __init__(self, model: SD3Model, config: EngineConfig | None = None, *, prompt_cache_size: int = 256,
                 return_prompt_embeds: bool = True, inference_kernels: bool = True):
        self.model = model
        self.inference_kernels = inference_kernels
        self.prompt_cache_size = prompt_cache_size
        self.return_prompt_embeds = return_prompt_embeds
        self._prompt_cache: OrderedDict[str, tuple[Tensor, Tensor]] = OrderedDict()
        self._sigmas: dict[int, Tensor] = {}
        super().__init__(config)

    # ---- helpers -----------------------------------------------------------------------------

    def compat_key(self, request: RolloutRequest) -> Hashable:
        if not isinstance(request.sampling, DiffusionSampling):  # runs alone, and fails in run_requests
            return ("invalid", request.request_id)
        return dataclasses.replace(self._sampling(request), negative_prompt="")

    def _sampling(self, request: RolloutRequest) -> DiffusionSampling:
        if not isinstance(request.sampling, DiffusionSampling):
            raise TypeError(f"request {request.request_id}: sampling must be a DiffusionSampling, "
                            f"not {type(request.sampling).__name__}")
        return request.sampling.resolved(self.model)

    def sigmas(self, num_steps: int) -> Tensor:
        """The schedule of `num_steps` steps, computed once (set_timesteps mutates the scheduler)."""
        if num_steps not in self._sigmas:
            self._sigmas[num_steps] = self.model.sigmas(num_steps).to(self.model.device)
        return self._sigmas[num_steps]

    def encode(self, texts: Sequence[str]) -> PromptEmbeds:
        """Embeddings of `texts` [len(texts), ...]: the ones not cached in one text-encoder forward."""
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"a diffusion prompt is a text, not {type(text).__name__}")
        missing = list(dict.fromkeys(t for t in texts if t not in self._prompt_cache))
        found = {t: self._prompt_cache[t] for t in texts if t in self._prompt_cache}
        if missing:
            fresh = self.model.encode_prompt(missing)
            for i, text in enumerate(missing):
                found[text] = (fresh.embeds[i : i + 1].clone(), fresh.pooled[i : i + 1].clone())
        for text in dict.fromkeys(texts):  # refresh the LRU order, then bound it
            self._prompt_cache[text] = found[text]
            self._prompt_cache.move_to_end(text)
        while len(self._prompt_cache) > self.prompt_cache_size:
            self._prompt_cache.popitem(last=False)
        if len(set(texts)) == 1:  # one prompt for all (the negative one): a broadcast view, no copies
            embeds, pooled = found[texts[0]]
            return PromptEmbeds(embeds.expand(len(texts), *embeds.shape[1:]),
                                pooled.expand(len(texts), *pooled.shape[1:]))
        return PromptEmbeds(torch.cat([found[t][0] for t in texts]), torch.cat([found[t][1] for t in texts]))

    def _result(self, request: RolloutRequest, sampling: DiffusionSampling, latents: Tensor, log_probs: Tensor,
                means: Tensor, sigmas: Tensor, cond: PromptEmbeds, uncond: PromptEmbeds | None) -> RolloutResult:
        extra: dict[str, Any] = {"latents": latents, "sigmas": sigmas.clone(), "means": means,
                                 "sampling": dataclasses.replace(sampling, negative_prompt=request.sampling.negative_prompt)}
        if self.return_prompt_embeds:
            extra["prompt_embeds"], extra["pooled_prompt_embeds"] = cond.embeds[0].clone(), cond.pooled[0].clone()
            if uncond is not None:
                extra["negative_prompt_embeds"] = uncond.embeds[0].clone()
                extra["negative_pooled_prompt_embeds"] = uncond.pooled[0].clone()
        return RolloutResult(request_id=request.request_id, seed=request.seed, policy_version=self.policy_version,
                             output=latents[-1].clamp(-1, 1), logprobs=log_probs, extra=extra)

    # ---- request-level -----------------------------------------------------------------------

    @torch.no_grad()
    def run_requests(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        sampling = self._sampling(requests[0])
        cond = self.encode([r.prompt for r in requests])
        uncond = self.encode([r.sampling.negative_prompt for r in requests]) if sampling.cfg else None
        sigmas = self.sigmas(sampling.num_steps)
        traj = sample_trajectories(self.model, cond, uncond, [r.seed for r in requests], sampling, sigmas,
                                   inference_kernels=self.inference_kernels)
        self.stats["forwards"] += sampling.num_steps
        return [  # clones: a result must not pin (or, pickled, carry) the whole batch's storage
            self._result(r, sampling, traj.latents[i].clone(), traj.log_probs[i].clone(), traj.means[i].clone(), sigmas,
                         PromptEmbeds(cond.embeds[i : i + 1], cond.pooled[i : i + 1]),
                         None if uncond is None else PromptEmbeds(uncond.embeds[i : i + 1], uncond.pooled[i : i + 1]))
            for i, r in enumerate(requests)
        ]

    # ---- step-level --------------------------------------------------------------------------

    @torch.no_grad()
    def start(self, request: RolloutRequest) -> _State:
        sampling = self._sampling(request)
        steps, shape, device = sampling.num_steps, sampling.shape(self.model), self.model.device
        generator = torch.Generator().manual_seed(int(request.seed))
        latents = torch.empty((steps + 1, *shape), dtype=torch.float32, device=device)
        latents[0] = draw_noise([generator], shape, device)[0]
        return _State(
            sampling=sampling,
            generator=generator,
            cond=self.encode([request.prompt]),
            uncond=self.encode([request.sampling.negative_prompt]) if sampling.cfg else None,
            sigmas=self.sigmas(steps),
            latents=latents,
            log_probs=torch.empty(steps, dtype=torch.float32, device=device),
            means=torch.empty((steps, *shape), dtype=torch.float32, device=device),
        )

    @torch.no_grad()
    def step(self, requests: list[RolloutRequest], states: list[_State]) -> None:
        """Advance every state by one denoising step in one forward; each at its own step index."""
        first = states[0]
        x = torch.stack([s.latents[s.j] for s in states])
        sigma = torch.stack([s.sigmas[s.j] for s in states])
        sigma_next = torch.stack([s.sigmas[s.j + 1] for s in states])
        cond = PromptEmbeds.cat([s.cond for s in states])
        uncond = PromptEmbeds.cat([s.uncond for s in states]) if first.sampling.cfg else None  # type: ignore[misc]
        x_next, log_prob, mean = denoise_step(self.model, x, sigma, sigma_next, cond, uncond, first.sampling,
                                              [s.generator for s in states], inference_kernels=self.inference_kernels)
        self.stats["forwards"] += 1
        for i, s in enumerate(states):
            s.latents[s.j + 1] = x_next[i]
            s.log_probs[s.j] = log_prob[i]
            s.means[s.j] = mean[i]
            s.j += 1

    def is_done(self, state: _State) -> bool:
        return state.j >= state.sampling.num_steps

    def finish(self, request: RolloutRequest, state: _State) -> RolloutResult:
        return self._result(request, state.sampling, state.latents, state.log_probs, state.means, state.sigmas,
                            state.cond, state.uncond)

    # ---- weights -----------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: dict[str, Any]) -> None:
        """Copy `weights` (transformer state-dict names: all of them, or a subset such as the LoRA
        adapter's) into the transformer in place; an unknown name or a shape mismatch is an error
        and then nothing is loaded. The text encoder is not trained, so cached prompts stay valid."""
        state = self.model.transformer.state_dict(keep_vars=True)
        unknown = sorted(k for k in weights if k not in state)
        if unknown:
            raise KeyError(f"weights for parameters the transformer does not have: {unknown[:5]}"
                           f"{' ...' if len(unknown) > 5 else ''}")
        for name, value in weights.items():
            if tuple(value.shape) != tuple(state[name].shape):
                raise ValueError(f"weight {name}: shape {tuple(value.shape)}, the transformer's is "
                                 f"{tuple(state[name].shape)}")
        for name, value in weights.items():
            state[name].copy_(value)
