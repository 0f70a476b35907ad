"""The shared trainer of every off-policy arm (App. J.2).

Recipe: one trace per micro-step, gradient accumulation to a global batch of 8, AdamW
(beta 0.9/0.95, no weight decay) at learning rate 1e-5 with a 5% linear warm-up and cosine decay,
gradient-norm clipping at 1, two epochs, gradient checkpointing, the loss on trace tokens only
(computed by the arm's objective, logits chunked). Two precisions: ``bf16`` — the weights
themselves in bf16, updated by plain AdamW with no fp32 master copy (how Mistill and its
controls trained); ``fp32`` — fp32 master weights with the forward under bf16 autocast.

The epoch order is a function of (seed, epoch). After every optimizer step the trainer can
save a resumable state (model, optimizer, scheduler, every RNG, position in the data); a run
resumed from it continues the same data order and random draws, bit for bit on CPU.

Data parallel over the processes of a ``torchrun`` launch (:mod:`mistill.distributed`): every
rank holds the same weights; each optimizer step's global batch (the next ``grad_accum``
examples of the epoch order) is dealt round-robin over the ranks, each rank back-propagates its
share scaled by the global batch size, and all-reduces of float32 buckets sum the gradients over
the ranks (the reduction DDP performs) before every rank takes the same clipped step. The global batch, the
data order, the schedule and the saved state are those of one process, so a run resumes on any
number of processes; the sums differ from one process's only in float summation order.

With ``sharding`` ``fsdp`` (the default for the fp32-master-weight arms on several processes)
the weights, their gradients and AdamW's state are sharded over the ranks by PyTorch's FSDP
(:func:`fully_shard_model`): the same examples, losses and summed gradients, each rank holding
its shard of the fp32 state. Every rank runs as many micro-steps as the busiest one (a rank
short of an example repeats the batch's first with weight 0), because FSDP's gathers and
reductions are collective. The saved state is the full one, in the same file as one
process's, so a run resumes sharded or not on any number of processes.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.utils.checkpoint
from torch import nn

from mistill.config import Config
from mistill.distributed import World, current_world, gather, shard
from mistill.distill.cpu_bf16 import fp32_gemms, use_fp32_gemms
from mistill.errors import MistillInputError
from mistill.instrument.passes import stable_seed
from mistill.io import atomic_open
from mistill.params import RecipeParams
from mistill.progress import track

PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class RecipeConfig(Config, RecipeParams):
    """The optimisation recipe (App. J.2 defaults): the shared fields of :class:`RecipeParams`
    (what the ``train`` stage exposes) and the ones the stage leaves at the paper's values.

    precision: ``bf16`` or ``fp32``; beta1, beta2, weight_decay: AdamW's.
    """

    seed: int = 0
    precision: str = "bf16"
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of the examples in an epoch: a function of (seed, epoch) only."""
    return np.random.default_rng(stable_seed(seed, "epoch", epoch)).permutation(n).tolist()


def steps_per_epoch(n: int, grad_accum: int) -> int:
    return math.ceil(n / grad_accum)


def total_steps(n: int, recipe: RecipeConfig) -> int:
    full = steps_per_epoch(n, recipe.grad_accum) * recipe.epochs
    return min(full, recipe.max_steps) if recipe.max_steps else full


def lr_lambda(step: int, total: int, warmup_frac: float) -> float:
    """Linear warm-up over ``warmup_frac`` of the steps, then cosine decay to zero."""
    warm = max(1, round(warmup_frac * total))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def checkpoint_layers(model: nn.Module) -> bool:
    """Activation checkpointing of every decoder layer's ``forward`` (non-reentrant).

    The checkpoint wraps ``forward``, not the module call, so module hooks (the trainer's
    :class:`~mistill.distill.attention_rows.LayerInputs`) run outside it, once, with gradients
    on, whatever the transformers release does with its own checkpointing (some wrap the whole
    call). Returns False when the model has no ``model.layers`` list to wrap.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    for layer in layers:
        if getattr(layer, "_mistill_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, _layer=layer, **kwargs):
            if _layer.training and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)
        layer.forward = forward
        layer._mistill_checkpointed = True
    return True


def training_precision(model: nn.Module, recipe: RecipeConfig) -> nn.Module:
    """The student's weights in the recipe's precision, trainable and in train mode; TF32 and the
    CPU's bf16 matmul kernels as the recipe says. Every arm's student starts here (the on-policy
    arms' trainers then add their own checkpointing)."""
    if recipe.precision not in PRECISIONS:
        raise MistillInputError(f"precision must be one of {PRECISIONS}", field="precision")
    model.to(torch.bfloat16 if recipe.precision == "bf16" else torch.float32)
    model.requires_grad_(True)
    model.train()
    if recipe.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    if use_fp32_gemms(recipe.cpu_bf16_matmul, next(model.parameters()).device, next(model.parameters()).dtype):
        fp32_gemms(model)
    return model


def prepare_student(model: nn.Module, recipe: RecipeConfig) -> nn.Module:
    """Put the student in its training precision and mode (:func:`training_precision`), with
    the recipe's gradient checkpointing and no KV cache."""
    training_precision(model, recipe)
    if recipe.gradient_checkpointing and not checkpoint_layers(model):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def autocast(recipe: RecipeConfig, device: torch.device):
    """bf16 autocast for fp32 master weights; nothing for bf16 weights."""
    if recipe.precision == "fp32":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from the run's seed."""
    random.seed(seed)
    np.random.seed(stable_seed(seed, "numpy") % 2 ** 32)
    torch.manual_seed(stable_seed(seed, "torch"))


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


MicroStep = Callable[[nn.Module, int], tuple[torch.Tensor, dict[str, float]]]


def uses_fsdp(recipe: RecipeConfig, world: World, *, extra_params: bool = False, probe: bool = False) -> bool:
    """Whether a run of ``recipe`` on ``world`` shards its weights (:class:`RecipeParams`
    ``sharding``). FSDP takes neither an arm's parameters outside the model (Feature-KD's
    adapter) nor the generation probe between steps: ``auto`` replicates such runs, ``fsdp``
    refuses them."""
    if not world.distributed or recipe.sharding == "replicate":
        return False
    if recipe.sharding == "fsdp":
        if extra_params:
            raise MistillInputError("sharding=fsdp does not take an arm's extra parameters (Feature-KD's "
                                    "adapter); use sharding=replicate", field="sharding")
        if probe:
            raise MistillInputError("the generation probe does not run on sharded weights; use "
                                    "sharding=replicate or probe_every=0", field="sharding")
        return True
    return recipe.precision == "fp32" and not extra_params and not probe


def fully_shard_model(model: nn.Module, world: World) -> None:
    """Shard ``model`` over the world's ranks with FSDP (``fully_shard``): each decoder layer a
    unit, the embeddings, final norm and head the root's. A unit's weights stay gathered from
    its forward to its backward (``reshard_after_forward=False``): the objectives read layer
    weights after the forward (the recomputed attention rows). Gradients are summed over the
    ranks, not averaged: each rank's loss is already scaled by the global batch."""
    # deferred: torch.distributed.device_mesh is slow to import
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # deferred: torch.distributed.fsdp is slow to import

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise MistillInputError("sharding=fsdp needs a model with a model.layers list", field="sharding")
    mesh = init_device_mesh(next(model.parameters()).device.type, (world.size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for unit in (*layers, model):  # each unit reduces its own gradients
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)


def unsharded_copy(model: nn.Module, state: dict) -> nn.Module:
    """A plain (unsharded) model of ``model``'s class and config holding ``state``, its full state
    dict, on the CPU: what is saved after a sharded run. Buffers outside the state dict (rotary
    frequencies) are copied from ``model``, where FSDP leaves them whole."""
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(state, assign=True, strict=False)
    if hasattr(fresh, "tie_weights"):
        fresh.tie_weights()
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = fresh.get_submodule(owner) if owner else fresh
        persistent = leaf not in getattr(module, "_non_persistent_buffers_set", set())
        module.register_buffer(leaf, buf.detach().to("cpu").clone(), persistent=persistent)
    left = [n for n, p in fresh.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"the gathered state misses parameters {left[:5]}")
    return fresh


def _fqn_optimizer_state(state: dict, names: Sequence[str]) -> dict:
    """An optimizer state dict keyed by parameter index as keyed by parameter name."""
    if all(isinstance(k, str) for k in state["state"]) and \
            all(isinstance(p, str) for g in state["param_groups"] for p in g["params"]):
        return state
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def _indexed_optimizer_state(state: dict, names: Sequence[str]) -> dict:
    """An optimizer state dict keyed by parameter name as keyed by parameter index."""
    index = {n: i for i, n in enumerate(names)}
    if all(isinstance(k, int) for k in state["state"]):
        return state
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


class Trainer:
    """Runs the recipe over ``n_examples`` with an arm's ``micro_step(model, example_index)``.

    ``micro_step`` returns the example's loss (a scalar with a graph) and its loss terms as
    floats; the trainer averages the loss over the micro-steps of each optimizer step.
    ``log(metrics, step)`` receives the averaged terms, the learning rate and the gradient norm
    after every optimizer step. ``state_dir`` holds the resumable state (``trainer_state.pt``).
    ``after_step(step, last)`` runs on every rank after each optimizer step and its checkpoint
    (``last``: the schedule's final step), e.g. the generation probe; it must leave the weights
    and the training RNG as it found them.
    """

    def __init__(self, model: nn.Module, n_examples: int, recipe: RecipeConfig, micro_step: MicroStep, *,
                 state_dir: Path | None = None, log: Callable[[dict, int], None] | None = None,
                 extra_params: Sequence[nn.Parameter] = (), world: World | None = None,
                 after_step: Callable[[int, bool], None] | None = None) -> None:
        if n_examples <= 0:
            raise MistillInputError("no training examples", field="notes")
        self.world = world or current_world()
        self.model = model
        self.n = n_examples
        self.recipe = recipe
        self.micro_step = micro_step
        self.state_dir = Path(state_dir) if state_dir else None
        self.log = log or (lambda metrics, step: None)
        self.after_step = after_step
        self.device = next(model.parameters()).device
        self.extra_params = list(extra_params)  # e.g. Feature-KD's adapter: saved and restored too
        self.fsdp = uses_fsdp(recipe, self.world, extra_params=bool(self.extra_params), probe=after_step is not None)
        if self.fsdp:
            fully_shard_model(model, self.world)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad] + self.extra_params
        self.optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=(recipe.beta1, recipe.beta2),
                                           weight_decay=recipe.weight_decay)
        self.total = total_steps(self.n, recipe)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, self.total, recipe.warmup_frac))
        self.step = 0
        self.epoch = 0
        self.cursor = 0  # position inside the epoch order
        seed_everything(recipe.seed)  # the arm's random draws; load_state() restores them on resume

    # -- resumable state --------------------------------------------------------------------
    @property
    def state_path(self) -> Path | None:
        return self.state_dir / "trainer_state.pt" if self.state_dir else None

    def full_state(self) -> tuple[dict, dict]:
        """The model's and the optimizer's full state dicts (the optimizer's keyed by parameter
        name when the model has every parameter, else by index). Under FSDP every rank must
        call it (the shards are gathered) and only rank 0 gets the tensors, on the CPU."""
        if self.fsdp:
            # deferred: torch.distributed.checkpoint.state_dict is slow to import
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            return get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        optimizer = self.optimizer.state_dict()
        if not self.extra_params:
            optimizer = _fqn_optimizer_state(optimizer, self.names)
        return self.model.state_dict(), optimizer

    def full_model_state(self) -> dict | None:
        """The model's full state dict to save after training: under FSDP gathered from every
        rank (all must call) onto rank 0's CPU (None elsewhere); else None (the model holds it)."""
        if not self.fsdp:
            return None
        # deferred: torch.distributed.checkpoint.state_dict is slow to import
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.world.leader else None

    def save_state(self) -> None:
        """Save the resumable state (written by rank 0; under FSDP every rank gathers)."""
        if self.state_path is None:
            return
        model_state, optimizer_state = self.full_state()
        if not self.world.leader:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {"model": model_state, "extra": [p.detach().clone() for p in self.extra_params],
                 "optimizer": optimizer_state,
                 "scheduler": self.scheduler.state_dict(), "step": self.step, "epoch": self.epoch,
                 "cursor": self.cursor, "rng": _rng_state(), "total": self.total}
        with atomic_open(self.state_path, "wb") as fh:
            torch.save(state, fh)

    def load_state(self) -> bool:
        """Restore the saved state if there is one; returns whether it did."""
        if self.state_path is None or not self.state_path.exists():
            return False
        state = torch.load(self.state_path, map_location=self.device, weights_only=False)
        if state["total"] != self.total:
            raise MistillInputError("saved trainer state belongs to another schedule", file=str(self.state_path),
                                    field="total_steps")
        if self.fsdp:
            # deferred: torch.distributed.checkpoint.state_dict is slow to import
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=_fqn_optimizer_state(state["optimizer"], self.names),
                           options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state["model"])
            with torch.no_grad():
                for p, saved in zip(self.extra_params, state.get("extra", [])):
                    p.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"] if self.extra_params
                                           else _indexed_optimizer_state(state["optimizer"], self.names))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.cursor = state["step"], state["epoch"], state["cursor"]
        _set_rng_state(state["rng"])
        return True

    # -- the loop -----------------------------------------------------------------------------
    def train(self, *, stop_after: int | None = None, progress: bool = True) -> int:
        """Train to the end of the schedule (or for ``stop_after`` more optimizer steps)."""
        bar = track(total=self.total, initial=self.step, desc="train", disable=not progress or not self.world.leader)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        done_now = 0
        while self.step < self.total and self.epoch < self.recipe.epochs:
            order = epoch_order(self.n, self.recipe.seed, self.epoch)
            batch = order[self.cursor:self.cursor + self.recipe.grad_accum]
            started = time.perf_counter()
            sums: dict[str, float] = {}
            micro = [(idx, 1.0) for idx in shard(batch, self.world)]  # every example of the batch, in one process
            if self.fsdp:  # as many micro-steps on every rank (FSDP's collectives); the padding weighs 0
                micro += [(batch[0], 0.0)] * (math.ceil(len(batch) / self.world.size) - len(micro))
            for idx, weight in micro:
                with autocast(self.recipe, self.device):
                    loss, parts = self.micro_step(self.model, idx)
                (loss * (weight / len(batch))).backward()
                for k, v in parts.items():
                    sums[k] = sums.get(k, 0.0) + weight * float(v) / len(batch)
            if self.world.distributed:
                if not self.fsdp:  # FSDP has summed the gradients into each rank's shard
                    _sum_gradients_over_ranks(params)
                sums = _sum_terms_over_ranks(sums, self.world, self.device)
            grad_norm = clip_gradients(params, self.recipe.clip, sharded=self.fsdp)
            if not torch.isfinite(grad_norm):
                # never let a NaN/inf update reach the weights silently
                raise FloatingPointError(f"non-finite gradient norm at optimizer step {self.step + 1} "
                                         f"(examples {batch}); the weights were not updated")
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.cursor += len(batch)
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
            self.log({**sums, "lr": lr, "grad_norm": float(grad_norm), "epoch": self.epoch,
                      **step_cost(time.perf_counter() - started, len(batch), self.device)}, self.step)
            if self.recipe.checkpoint_every and self.step % self.recipe.checkpoint_every == 0:
                self.save_state()
            if self.after_step is not None:
                self.after_step(self.step, self.step >= self.total or self.epoch >= self.recipe.epochs)
            bar.update(1)
            done_now += 1
            if stop_after is not None and done_now >= stop_after:
                break
        bar.close()
        return self.step


COST_METRICS: tuple[str, ...] = ("step_seconds", "peak_memory_gib")
"""The logged step metrics that measure the machine, not the training: two runs that train alike
differ in them (on other hardware, or with the batch split over processes)."""


def step_cost(seconds: float, notes: int, device: torch.device) -> dict[str, float]:
    """What an optimizer step cost (App. I.5), logged beside its terms: ``step_seconds`` (wall
    time of its micro-steps, gradient sum, clipping and update; not the probe or a checkpoint
    save), ``step_notes`` (the notes of its batch) and, on a CUDA device, ``peak_memory_gib``
    (the most memory torch has held on it since the process started, in GiB)."""
    cost = {"step_seconds": float(seconds), "step_notes": float(notes)}
    if device.type == "cuda":
        cost["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return cost


ALLREDUCE_BUCKET = 1 << 24
"""Gradient elements summed per all-reduce (64 MB in float32; a larger parameter is a bucket of
its own): the sum runs in float32 whatever the weights' dtype, a bucket at a time, so its extra
memory stays bounded."""


SQUARES_CHUNK = 1 << 24
"""Gradient elements squared at a time when the norm is taken (64 MB in float32)."""


@torch.no_grad()
def clip_gradients(params: Sequence[nn.Parameter], max_norm: float, *, sharded: bool = False) -> torch.Tensor:
    """Gradient-norm clipping (App. J.2: at 1), as ``torch.nn.utils.clip_grad_norm_`` scales, with
    the norm from float32 sums of squares (chunks of :data:`SQUARES_CHUNK`), exact to float32
    rounding on every device (torch's CPU norm kernel can be off by 1e-4 on a large float32
    gradient). ``sharded``: the gradients are FSDP's shards, the sums all-reduced over the ranks,
    so a run clips alike sharded or not. Returns the norm before clipping."""
    grads = [p.grad.to_local() if sharded else p.grad for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for g in grads:
        for part in g.reshape(-1).split(SQUARES_CHUNK):
            squares += part.float().pow(2).sum()
    if sharded:
        import torch.distributed as dist  # deferred: torch.distributed is slow to import

        dist.all_reduce(squares)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _sum_gradients_over_ranks(params: Sequence[nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks in place (all-reduces of float32 buckets;
    a rank without examples in this step contributes zeros)."""
    import torch.distributed as dist  # deferred: torch.distributed is slow to import

    bucket: list[nn.Parameter] = []

    def flush() -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(bucket, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()
        bucket.clear()

    size = 0
    for p in params:
        if bucket and size + p.numel() > ALLREDUCE_BUCKET:
            flush()
            size = 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        flush()


def _sum_terms_over_ranks(sums: dict[str, float], world: World, device: torch.device) -> dict[str, float]:
    """The loss terms summed over the ranks (every rank returns the same)."""
    import torch.distributed as dist  # deferred: torch.distributed is slow to import

    terms = sorted(set().union(*gather(sorted(sums), world)))
    values = torch.tensor([sums.get(k, 0.0) for k in terms], dtype=torch.float64, device=device)
    dist.all_reduce(values)  # on the weights' device: NCCL reduces GPU tensors only
    return dict(zip(terms, values.tolist()))
