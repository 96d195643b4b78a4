"""`omni_cpu`: a rollout for verl 0.9.1's main_ppo (GRPO, GSPO) that generates with transformers on CPU.

Runs inside verl's interpreter, never in ours: `backend: {name: verl, device: cpu}` renders
`actor_rollout_ref.rollout.name=omni_cpu` and lists this module (after the `cpu` platform,
omni_verl_cpu.py) in `VERL_USE_EXTERNAL_MODULES`, so `import verl` imports it in every process of the
job: the TaskRunner (which looks the replica up), the actor worker (which builds the adapter), the
agent loops and the server actor.

verl's async rollout contract, as vLLM's rollout implements it (verl/workers/rollout/replica.py,
base.py, vllm_rollout/):
- `CPUReplica` (a `RolloutReplica`, registered in `RolloutReplicaRegistry`): `launch_servers` starts
  one `CPURolloutServer` actor per replica, named `omni_cpu_server_{replica}_0`. main_ppo's trainer
  calls `init_hybrid` (the actor's worker group passed in), which calls `launch_servers`.
- `CPURolloutServer.generate(prompt_ids, sampling_params, request_id)` returns a `TokenOutput`: the
  response token ids (EOS included) and, when `sampling_params["logprobs"]`, each token's
  `log_softmax(logits / temperature)`, which is what the actor recomputes
  (`training/rollout_probs_diff_*` in verl's metrics); `extra_fields.global_steps` is the weights'
  version. With no `max_tokens`, the budget is vLLM's: min(response_length, prompt_length +
  response_length - len(prompt)).
- `CPURolloutAdapter` (a `BaseRollout`, in `_ROLLOUT_REGISTRY[("omni_cpu", "async")]`) lives in the
  actor worker: `update_weights` receives the trainer's full parameters by Hugging Face name
  (verl's "naive" sync: engine_workers.ActorRolloutRefWorker.update_weights) and sends them to its
  replica's server, which copies them in place. `resume` / `release` have nothing to free on CPU.

Batching and determinism (seeded runs give identical weights, also across a resume):
- A GRPO step sends its n samples of a prompt as n identical requests (verl's agent loop fires every
  prompt's n sessions at once). They are generated together, one forward for the n rows a token (a group:
  the first `min(n, max_num_seqs)` identical requests to arrive; n is `rollout.n`, or `val_kwargs.n` for
  validation's sampling). Only identical requests share a forward, so no row's logits depend on which
  other prompts happened to arrive alongside (a timing accident): the batch's composition, hence every
  sample and log-prob, is the same on every run. A group that does not fill within `GROUP_WAIT_S` (a
  per-sample `__rollout_n__`, an abort) runs with what came, saying so; requests whose sampling matches
  neither the training's nor the validation's (or both, with different n) run one at a time.
- Row k of a group draws with its own `torch.Generator` seeded from (the rollout seed, the weights'
  version, the prompt, the sampling parameters, k), k counting identical requests since the last weight
  update. The n samples of a prompt are then the same multiset whatever order verl's agent loops send
  them in.
- verl's sync replay buffer lists a batch's samples in the order the agent loops finished
  (trainer/ppo/v1/replay_buffer.py, keyed by uuid4s), and the same samples summed in another order
  give other weights through Adam. `_deterministic_batch_order` sorts them by the prompt's
  submission order, then by response tokens.

Also: verl's `ResourcePoolManager` checks the cluster's GPUs before placing its workers; with the
`cpu` platform the workers ask for CPUs, so the check counts CPUs instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import ray
import torch
from verl.single_controller.ray import base as ray_base
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "omni_cpu"
GROUP_WAIT_S = 10.0  # how long the first of a group waits for the rest before it runs with what came


def server_name(replica_rank: int) -> str:
    return f"{NAME}_server_{replica_rank}_0"  # vLLM's naming: the adapter finds its server by it


def request_seed(base: int, version: int | None, prompt_ids: list[int], sampling: dict, k: int) -> int:
    text = json.dumps([base, version, prompt_ids, sorted(sampling.items()), k])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                 generator: torch.Generator) -> tuple[int, float]:
    """One token from the last position's logits and its log-prob under log_softmax(logits / temperature)."""
    if temperature <= 0:  # greedy (validation's default)
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if top_k > 0:
        probs = torch.where(probs < torch.topk(probs, top_k).values[-1], 0.0, probs)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < top_p
        probs = torch.where(torch.zeros_like(keep).scatter(0, order, keep), probs, 0.0)
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, float(logp[token])


class CPURolloutServer:
    """One replica's model (a Ray actor): generates a group of identical requests at a time (module
    docstring), weights pushed by the adapter."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path, dtype=torch.float32, attn_implementation="sdpa",
            trust_remote_code=self.model_config.trust_remote_code).eval()
        eos = self.model.generation_config.eos_token_id
        eos = self.model.config.eos_token_id if eos is None else eos
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self.lock = asyncio.Lock()  # one generation (or weight update) at a time
        self.seen: dict[str, int] = {}  # identical requests since the last weight update
        self.waiting: dict[str, list[asyncio.Future]] = {}  # a group's requests that arrived so far
        self.generated = {"requests": 0, "groups": 0, "largest": 0}  # since the last weight update

    async def update_weights(self, state: dict[str, torch.Tensor]) -> int:
        async with self.lock:
            targets = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
            unknown = sorted(set(state) - set(targets) - {"lm_head.weight"})  # lm_head may be tied (absent)
            if unknown:
                raise ValueError(f"{NAME} rollout: the trainer sent weights the model lacks: {unknown[:5]}")
            with torch.no_grad():
                for name, tensor in state.items():
                    if name in targets:
                        targets[name].copy_(tensor)
            self.seen = {}
        return len(state)

    async def set_global_steps(self, global_steps: int | None) -> None:
        if self.generated["requests"]:  # the previous weights' generation, in the job's log
            print(f"{NAME} rollout: weights version {self.global_steps}: {self.generated['requests']} requests in "
                  f"{self.generated['groups']} groups (largest {self.generated['largest']})", flush=True)
        self.generated = {"requests": 0, "groups": 0, "largest": 0}
        self.global_steps = global_steps
        self.seen = {}

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                       **kwargs) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError(f"{NAME} rollout: multimodal input is not supported (text prompts only)")
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        budget = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if budget is None:
            budget = min(self.config.response_length,
                         self.config.prompt_length + self.config.response_length - len(prompt_ids))
        budget = max(1, int(budget))
        if float(params.get("repetition_penalty", 1.0)) != 1.0:
            raise ValueError(f"{NAME} rollout: repetition_penalty is not supported")
        key = json.dumps([prompt_ids, sorted(params.items()), budget])
        mine = asyncio.get_running_loop().create_future()
        members = self.waiting.setdefault(key, [])
        members.append(mine)
        if len(members) >= self.group_size(params):
            del self.waiting[key]
            await self._run_group(key, members, prompt_ids, params, budget)
        else:
            try:
                await asyncio.wait_for(asyncio.shield(mine), GROUP_WAIT_S)
            except TimeoutError:
                if self.waiting.get(key) and mine in self.waiting[key]:  # still unfilled: run what came
                    members = self.waiting.pop(key)
                    print(f"{NAME} rollout: a group of {len(members)} identical requests (not "
                          f"{self.group_size(params)}) ran after {GROUP_WAIT_S} s", flush=True)
                    await self._run_group(key, members, prompt_ids, params, budget)
        tokens, log_probs = await mine
        return TokenOutput(token_ids=tokens, log_probs=log_probs if params.get("logprobs") else None,
                           stop_reason="completed", extra_fields={"global_steps": self.global_steps})

    def group_size(self, params: dict) -> int:
        """How many identical requests are generated together (module docstring)."""
        cfg = self.config
        sampling = (float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0)),
                    int(params.get("top_k", -1) or -1))
        train = sampling == (float(cfg.temperature), float(cfg.top_p), int(cfg.top_k or -1))
        val = sampling == (float(cfg.val_kwargs.temperature), float(cfg.val_kwargs.top_p),
                           int(cfg.val_kwargs.top_k or -1))
        if train and val:
            n = cfg.n if cfg.n == cfg.val_kwargs.n else 1
        else:
            n = cfg.n if train else cfg.val_kwargs.n if val else 1
        return max(1, min(int(n), int(getattr(cfg, "max_num_seqs", n) or n)))

    async def _run_group(self, key: str, members: list[asyncio.Future], prompt_ids: list[int], params: dict,
                         budget: int) -> None:
        try:
            async with self.lock:
                k = self.seen.get(key, 0)
                self.seen[key] = k + len(members)
                base = getattr(self.config, "seed", 0)
                seeds = [request_seed(base, self.global_steps, prompt_ids, params, k + i) for i in range(len(members))]
                rows = await asyncio.to_thread(self._generate, prompt_ids, params, budget, seeds)
                self.generated = {"requests": self.generated["requests"] + len(members),
                                  "groups": self.generated["groups"] + 1,
                                  "largest": max(self.generated["largest"], len(members))}
        except BaseException as exc:
            for member in members:
                if not member.done():
                    member.set_exception(exc)
            raise
        for member, row in zip(members, rows, strict=True):
            member.set_result(row)

    def _generate(self, prompt_ids: list[int], params: dict, budget: int,
                  seeds: list[int]) -> list[tuple[list[int], list[float]]]:
        """One response per seed to the same prompt, generated together (one forward a token for all rows);
        a finished row keeps being fed its last token until every row is done (its output is ignored)."""
        temperature, top_p = float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        ids, past = torch.tensor([prompt_ids] * len(seeds)), None
        rows: list[tuple[list[int], list[float]]] = [([], []) for _ in seeds]
        done = [False] * len(seeds)
        with torch.no_grad():
            for _ in range(budget):
                out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1].float()
                fed = []
                for b, (tokens, log_probs) in enumerate(rows):
                    if not done[b]:
                        token, log_prob = sample_token(logits[b], temperature, top_p, top_k, generators[b])
                        tokens.append(token)
                        log_probs.append(log_prob)
                        done[b] = token in self.eos and not self.config.ignore_eos
                    fed.append(tokens[-1])
                if all(done):
                    break
                ids = torch.tensor(fed).unsqueeze(1)
        return rows

    # the control calls RolloutReplica and verl's trainer make; nothing to free or pause on CPU
    async def wake_up(self, tags=None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reset_prefix_cache=True, reject_request=False):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        return None


class CPURolloutAdapter(BaseRollout):
    """The rollout as the actor worker holds it: forwards the trainer's weights to its replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        ranks_per_replica = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        self.replica_rank = rank // ranks_per_replica if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % ranks_per_replica == 0
        self._server = None

    def server(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"{NAME} rollout: weight sync {wire_format!r} is not supported (named_tensors only)")
        if kwargs.get("peft_config") is not None:
            raise ValueError(f"{NAME} rollout: unmerged LoRA adapters are not supported; set "
                             "actor_rollout_ref.model.lora.merge=true")
        # copies: the generator may hand out views of live parameters
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self.is_leader_rank:
            await self.server().update_weights.remote(state)
            await self.server().set_global_steps.remote(global_steps)


class CPUReplica(RolloutReplica):
    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        name = server_name(self.replica_rank)
        server = ray.remote(CPURolloutServer).options(
            name=name, max_concurrency=self.max_concurrency, num_cpus=0).remote(
            self.config, self.model_config, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{NAME}://{name}"  # only the load balancer's key (no HTTP server)
        await server.sleep.remote()


def _check_cpus_available(self) -> None:
    """ResourcePoolManager._check_resource_available, counting the CPUs the cpu platform's workers ask for."""
    available = sum(node.get("CPU", 0) for node in ray._private.state.available_resources_per_node().values())
    required = sum(n for per_node in self.resource_pool_spec.values() for n in per_node)
    if available < required:
        raise ValueError(f"{NAME}: the Ray cluster has {available} free CPUs, verl's workers need {required} "
                         "(besides the TransferQueue's; start it with `ray start --head --num-cpus 8`)")


def _deterministic_batch_order(materialize):
    """Wrap ReplayBuffer._materialize_batch: its samples sorted by prompt submission order, then response."""
    import transfer_queue as tq
    from verl.trainer.ppo.v1.replay_buffer import KVBatchMeta

    def materialize_sorted(self, partition_id, selected_prompt_uids, partition_snapshot):
        meta = materialize(self, partition_id, selected_prompt_uids, partition_snapshot)
        if not meta.keys:
            return meta
        submitted = {uid: i for i, uid in enumerate(self.prompt_global_steps[partition_id])}
        rows = tq.kv_batch_get(keys=list(meta.keys), partition_id=partition_id, select_fields=["responses"])
        responses = [tuple(r.tolist()) for r in rows["responses"].unbind(0)]
        order = sorted(range(len(meta.keys)), key=lambda i: (
            submitted.get(meta.keys[i].split("_")[0], len(submitted)), responses[i], meta.keys[i]))
        return KVBatchMeta(partition_id=partition_id, keys=[meta.keys[i] for i in order],
                           tags=[meta.tags[i] for i in order])

    return materialize_sorted


def register() -> None:
    from verl.trainer.ppo.v1 import replay_buffer

    RolloutReplicaRegistry.register(NAME, lambda: CPUReplica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.CPURolloutAdapter"
    ray_base.ResourcePoolManager._check_resource_available = _check_cpus_available
    buffer = replay_buffer.ReplayBuffer
    if not getattr(buffer._materialize_batch, "omni_sorted", False):
        buffer._materialize_batch = _deterministic_batch_order(buffer._materialize_batch)
        buffer._materialize_batch.omni_sorted = True


register()
