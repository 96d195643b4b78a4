"""A text-to-image rectified-flow model as one object: SD3 transformer, scheduler, text encoder, tokenizer.

`SD3Model` is what `load_model("tiny://sd3")` returns. It denoises in the space its pipeline file
names: `pixel` (3-channel images in [-1, 1], no VAE; what `tiny://sd3` does) - so image rewards see
the very pixels the transformer produced. Everything here is stateless: a denoising step is a pure
function of (x, sigma), so rollout engines can batch requests that are at different steps.

Conventions (diffusers' SD3 / flow matching): x_sigma = (1 - sigma) * x_0 + sigma * noise; the
transformer predicts the velocity v = noise - x_0 at timestep t = sigma * num_train_timesteps; an
ODE Euler step is x_next = x + (sigma_next - sigma) * v.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

PIPELINE_FILE = "omni_pipeline.json"  # marks a directory as one of these component folders


@dataclass(frozen=True)
class PromptEmbeds:
    """Text conditioning for a batch: per-token `embeds` [B, L, D] and `pooled` [B, P]."""

    embeds: Tensor
    pooled: Tensor

    def __len__(self) -> int:
        return self.embeds.shape[0]

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        return PromptEmbeds(torch.cat([p.embeds for p in parts]), torch.cat([p.pooled for p in parts]))


@dataclass
class SD3Model:
    """diffusers' `SD3Transformer2DModel` + `FlowMatchEulerDiscreteScheduler` + a CLIP text encoder."""

    transformer: Any  # SD3Transformer2DModel, or a peft model wrapping it
    scheduler: Any  # FlowMatchEulerDiscreteScheduler
    text_encoder: Any  # CLIPTextModelWithProjection
    tokenizer: Any
    space: str = "pixel"
    sample_size: int = 32
    channels: int = 3
    max_text_length: int = 64

    # ---- text ------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> PromptEmbeds:
        """CLIP penultimate hidden states (as SD3 uses them) and the projected pooled output."""
        enc = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.max_text_length,
            truncation=True,
            return_tensors="pt",
        )
        device = self.device
        out = self.text_encoder(input_ids=enc["input_ids"].to(device), output_hidden_states=True)
        return PromptEmbeds(out.hidden_states[-2], out.text_embeds)

    def negative_embeds(self, batch: int, negative_prompt: str = "") -> PromptEmbeds:
        """The unconditional branch of classifier-free guidance: `negative_prompt` (default empty)."""
        return self.encode_prompt([negative_prompt] * batch)

    # ---- denoising ---------------------------------------------------------------------------

    def sigmas(self, num_steps: int) -> Tensor:
        """The scheduler's noise levels for `num_steps` steps: a float32 tensor of num_steps + 1
        values from 1 down to 0 (shift applied)."""
        self.scheduler.set_timesteps(num_steps)
        return self.scheduler.sigmas.detach().clone().float()

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        shape = (batch, self.channels, self.sample_size, self.sample_size)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)

    def velocity(
        self,
        x: Tensor,
        sigma: Tensor | float,
        cond: PromptEmbeds,
        *,
        uncond: PromptEmbeds | None = None,
        guidance_scale: float = 1.0,
    ) -> Tensor:
        """The transformer's velocity at noise level `sigma` (a scalar or one per sample).

        With `uncond` and `guidance_scale` != 1 it is True-CFG in one batched forward over
        [uncond; cond]: v = v_u + w * (v_c - v_u).
        """
        batch = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(batch)
        timestep = sigma * self.scheduler.config.num_train_timesteps
        if uncond is None or guidance_scale == 1.0:
            return self._forward(x, timestep, cond)
        both = PromptEmbeds.cat([uncond, cond])
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([timestep, timestep]), both).chunk(2)
        return v_u + guidance_scale * (v_c - v_u)

    def _forward(self, x: Tensor, timestep: Tensor, text: PromptEmbeds) -> Tensor:
        return self.transformer(
            hidden_states=x,
            encoder_hidden_states=text.embeds,
            pooled_projections=text.pooled,
            timestep=timestep,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        *,
        num_steps: int = 10,
        guidance_scale: float = 1.0,
        negative_prompt: str = "",
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Images for `prompts` by the deterministic (ODE) Euler sampler: [B, C, H, W] in [-1, 1]."""
        cond = self.encode_prompt(prompts)
        uncond = self.negative_embeds(len(prompts), negative_prompt) if guidance_scale != 1.0 else None
        x = self.initial_noise(len(prompts), generator)
        sigmas = self.sigmas(num_steps).to(x.device)
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
            v = self.velocity(x, sigma, cond, uncond=uncond, guidance_scale=guidance_scale)
            x = x + (sigma_next - sigma) * v
        return x.clamp(-1, 1)

    # ---- pixels ------------------------------------------------------------------------------

    @staticmethod
    def to_uint8(x: Tensor) -> np.ndarray:
        """[B, 3, H, W] samples in [-1, 1] -> [B, H, W, 3] uint8 images (what image rewards score)."""
        pixels = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu().numpy()

    def to_pil(self, x: Tensor) -> list:
        from PIL import Image

        return [Image.fromarray(img) for img in self.to_uint8(x)]

    # ---- module plumbing ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def to(self, device: str | torch.device) -> SD3Model:
        self.transformer.to(device)
        self.text_encoder.to(device)
        return self

    def eval(self) -> SD3Model:
        self.transformer.eval()
        self.text_encoder.eval()
        return self

    def parameters(self):
        """The transformer's parameters (the trained part)."""
        return self.transformer.parameters()


def read_pipeline_file(path: str | Path) -> dict | None:
    """The pipeline description of a component folder, or None when `path` is not one."""
    file = Path(path) / PIPELINE_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def load_sd3(path: str | Path) -> SD3Model:
    """Load an `SD3Model` from a component folder (see `tiny_sd3.build` for the layout)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    path = Path(path)
    spec = read_pipeline_file(path)
    if spec is None:
        raise FileNotFoundError(f"{path} has no {PIPELINE_FILE}")
    if spec.get("kind") != "sd3" or spec.get("space") != "pixel":
        raise ValueError(f"{path}: only pixel-space SD3 folders are supported, not {spec}")
    parts = spec["components"]
    model = SD3Model(
        transformer=SD3Transformer2DModel.from_pretrained(path / parts["transformer"]),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path / parts["scheduler"]),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(path / parts["text_encoder"]),
        tokenizer=AutoTokenizer.from_pretrained(path / parts["tokenizer"]),
        space=spec["space"],
        sample_size=spec["sample_size"],
        channels=spec["channels"],
        max_text_length=spec["max_text_length"],
    )
    return model.eval()
