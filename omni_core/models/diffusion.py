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
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
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
        inference_kernels: bool = False,
    ) -> Tensor:
        """The transformer's velocity at noise level `sigma` (a scalar or one per sample).

        With `uncond` and `guidance_scale` != 1 it is True-CFG in one batched forward over
        [uncond; cond]: v = v_u + w * (v_c - v_u). `inference_kernels`: without autograd, run the
        transformer through `sd3_inference_forward` (same math, fewer passes over memory; equal to
        the plain forward up to float rounding, ~1e-7); the rollout engine asks for it.
        """
        batch = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(batch)
        timestep = sigma * self.scheduler.config.num_train_timesteps
        if uncond is None or guidance_scale == 1.0:
            return self._forward(x, timestep, cond, inference_kernels)
        both = PromptEmbeds.cat([uncond, cond])
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([timestep, timestep]), both, inference_kernels).chunk(2)
        return v_u + guidance_scale * (v_c - v_u)

    def _forward(self, x: Tensor, timestep: Tensor, text: PromptEmbeds, inference_kernels: bool = False) -> Tensor:
        if inference_kernels and not torch.is_grad_enabled():
            out = sd3_inference_forward(self.transformer, x, timestep, text.embeds, text.pooled)
            if out is not None:
                return out
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


# ---- inference forward -----------------------------------------------------------------------

_GELU_TANH_C = 2 * math.sqrt(2 / math.pi)


def _gelu_tanh_(h: Tensor) -> Tensor:
    """GELU (tanh approximation) of `h`, in place: x * sigmoid(2c (x + 0.044715 x^3)), which is
    0.5 x (1 + tanh(c (x + 0.044715 x^3))) in 4 passes; torch's tanh kernel is ~4 ns/element here
    (a third of a batched forward), its sigmoid ~1 ns. Equal to F.gelu(approximate="tanh") to ~5e-7."""
    z = torch.addcmul(h.new_tensor(_GELU_TANH_C), h, h, value=_GELU_TANH_C * 0.044715)
    return h.mul_(z.mul_(h).sigmoid_())


def _modulate(normed: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """normed * (1 + scale) + shift per sample, in one pass."""
    return torch.addcmul(shift[:, None], normed, (1 + scale)[:, None])


def _rms(norm: Any, x: Tensor) -> Tensor:
    if norm is None:
        return x
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _supported(t: Any) -> bool:
    """Whether `t` is the SD3 transformer shape `sd3_inference_forward` implements (SD3 / SD3.5 joint
    blocks with the stock processors, tanh-GELU feed-forwards, no chunking, no active dropout)."""
    from diffusers import SD3Transformer2DModel
    from diffusers.models.activations import GELU
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from diffusers.models.normalization import (
        AdaLayerNormContinuous,
        AdaLayerNormZero,
        RMSNorm,
        SD35AdaLayerNormZeroX,
    )

    if not isinstance(t, SD3Transformer2DModel):
        return False
    for block in t.transformer_blocks:
        attns = [block.attn] + ([block.attn2] if block.use_dual_attention else [])
        norms = [a.norm_q for a in attns] + [a.norm_k for a in attns] + [block.attn.norm_added_q, block.attn.norm_added_k]
        feeds = [block.ff] + ([] if block.context_pre_only else [block.ff_context])
        if (block._chunk_size is not None
                or not isinstance(block.norm1, SD35AdaLayerNormZeroX if block.use_dual_attention else AdaLayerNormZero)
                or not isinstance(block.norm1_context, AdaLayerNormContinuous if block.context_pre_only else AdaLayerNormZero)
                or any(type(a.processor) is not JointAttnProcessor2_0 for a in attns)
                or any(n is not None and not (isinstance(n, RMSNorm) and n.weight is not None and n.bias is None)
                       for n in norms)
                or any(not (isinstance(f.net[0], GELU) and f.net[0].approximate == "tanh") or len(f.net) != 3
                       for f in feeds)
                or (t.training and any(getattr(d, "p", 0) > 0 for d in
                                       [f.net[1] for f in feeds] + [a.to_out[1] for a in attns]))):
            return False
    return True


def _attention(attn: Any, x: Tensor, context: Tensor | None, context_out: bool) -> tuple[Tensor, Tensor | None]:
    """diffusers' JointAttnProcessor2_0 over [x; context] (context_out False: the context rows' outputs
    are not needed, so their queries are left out; the image rows' outputs are the same)."""
    batch, n, heads = x.shape[0], x.shape[1], attn.heads
    q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    d = q.shape[-1] // heads
    q, k, v = (_rms(attn.norm_q, q.view(batch, n, heads, d)), _rms(attn.norm_k, k.view(batch, n, heads, d)),
               v.view(batch, n, heads, d))
    if context is not None:
        ek = _rms(attn.norm_added_k, attn.add_k_proj(context).view(batch, -1, heads, d))
        ev = attn.add_v_proj(context).view(batch, -1, heads, d)
        k, v = torch.cat([k, ek], 1), torch.cat([v, ev], 1)
        if context_out:
            q = torch.cat([q, _rms(attn.norm_added_q, attn.add_q_proj(context).view(batch, -1, heads, d))], 1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    o = o.transpose(1, 2).reshape(batch, -1, heads * d)
    if context is not None and context_out:
        return attn.to_out[0](o[:, :n]), attn.to_add_out(o[:, n:])
    return attn.to_out[0](o), None


def _feed_forward(ff: Any, x: Tensor) -> Tensor:
    return ff.net[2](_gelu_tanh_(ff.net[0].proj(x)))


@torch.no_grad()
def sd3_inference_forward(transformer: Any, x: Tensor, timestep: Tensor, embeds: Tensor, pooled: Tensor) -> Tensor | None:
    """`SD3Transformer2DModel.forward` (diffusers 0.3x-0.4x, no ControlNet / IP-adapter / skipped layers)
    for inference: the same modules (so LoRA layers and `disable_adapter` apply), with the elementwise
    work in fewer passes (modulations and gated residuals as one addcmul each, RMS norms fused, GELU
    through sigmoid) and without the queries of context rows whose outputs the last block discards.
    None when the transformer is not a shape it knows (the caller then runs the plain forward)."""
    t = transformer.get_base_model() if hasattr(transformer, "get_base_model") else transformer
    if not _supported(t):
        return None
    height, width = x.shape[-2:]
    h = t.pos_embed(x).contiguous()
    temb = t.time_text_embed(timestep, pooled)
    c = t.context_embedder(embeds)
    for block in t.transformer_blocks:
        emb = block.norm1.linear(block.norm1.silu(temb))
        normed = block.norm1.norm(h)
        if block.use_dual_attention:
            shift, scale, gate, shift_mlp, scale_mlp, gate_mlp, shift2, scale2, gate2 = emb.chunk(9, dim=1)
            normed2 = _modulate(normed, shift2, scale2)
        else:
            shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        normed = _modulate(normed, shift, scale)
        if block.context_pre_only:
            c_normed = block.norm1_context(c, temb)
        else:
            c_emb = block.norm1_context.linear(block.norm1_context.silu(temb))
            c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = c_emb.chunk(6, dim=1)
            c_normed = _modulate(block.norm1_context.norm(c), c_shift, c_scale)
        out, c_out = _attention(block.attn, normed, c_normed, not block.context_pre_only)
        h = torch.addcmul(h, gate[:, None], out)
        if block.use_dual_attention:
            h.addcmul_(gate2[:, None], _attention(block.attn2, normed2, None, False)[0])
        h.addcmul_(gate_mlp[:, None], _feed_forward(block.ff, _modulate(block.norm2(h), shift_mlp, scale_mlp)))
        if block.context_pre_only:
            c = None
        else:
            c = torch.addcmul(c, c_gate[:, None], c_out)
            c.addcmul_(c_gate_mlp[:, None],
                       _feed_forward(block.ff_context, _modulate(block.norm2_context(c), c_shift_mlp, c_scale_mlp)))
    h = t.proj_out(t.norm_out(h, temb))
    p, channels = t.config.patch_size, t.out_channels
    h = h.reshape(h.shape[0], height // p, width // p, p, p, channels)
    return torch.einsum("nhwpqc->nchpwq", h).reshape(h.shape[0], channels, height, width)


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
