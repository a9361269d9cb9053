"""Where a training process runs and how the draft is spread over ranks: the rank/world from torchrun's
environment, the process group, FSDP2 sharding of the draft and the full-state-dict options checkpoints
and the held-out curve gather with. See docs/design/training.md, "Trainer".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepspec.device import allow_tf32, resolve_device
from deepspec.train.config import TrainConfig
from deepspec.train.data import map_tensors
from deepspec.utils import torchrun_env


@dataclass
class Dist:
    """This process's place in the run: rank/world from torchrun's environment (0/1 without it)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    created_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def setup_distributed(device_name: str = "auto") -> Dist:
    """Read ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (set by torchrun) and place this process on
    :func:`deepspec.device.resolve_device` of ``device_name`` (``auto``: ``cuda:LOCAL_RANK`` when CUDA
    is available, else the CPU); with a world of more than one process, create the default process
    group (NCCL on CUDA, gloo on the CPU). Raises ValueError for a device that is not there."""
    rank, world_size, local_rank = torchrun_env()
    device = resolve_device(device_name, "train.device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        allow_tf32()
    created = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    return Dist(rank, world_size, local_rank, device, created)


def shard_model(model: torch.nn.Module, cfg: TrainConfig, ctx: Dist) -> torch.nn.Module:
    """FSDP2 (``fully_shard``) over a 1-D mesh of all ranks.

    Units: each module the model lists in ``fsdp_units()`` (optional; modules whose parameters are
    used only inside their own ``forward``, e.g. decoder layers that compute everything in their
    forward), then the root, which holds every remaining trainable parameter. The DSpark/DFlash drafts
    list none today: their ``forward_train`` calls ``layer.self_attn.context_kv`` outside the layer's
    forward, which per-layer units would run on still-sharded weights; the draft is a few layers, so
    one unit costs one all-gather of the trainable weights per forward.

    Frozen parameters (the target's embedding and lm_head copies) are *ignored* by FSDP: replicated and
    unsharded on every rank (no gradient, so sharding them would only add all-gathers; a loss may call
    ``model.lm_head`` outside the forward). Trainable parameters keep fp32 master shards; with
    ``dtype="bf16"`` the all-gathered compute copies are bf16 and gradients are reduced in fp32.
    ``forward_train`` is registered so FSDP's unshard/reshard hooks run for it as for ``forward``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.uses_bf16(ctx.device)
        else MixedPrecisionPolicy()
    )
    frozen = {p for p in model.parameters() if not p.requires_grad}
    units = model.fsdp_units() if callable(getattr(model, "fsdp_units", None)) else []
    for unit in units:
        ignored = {p for p in unit.parameters() if p in frozen}
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=frozen or None)
    for method in ("forward_train",):
        if callable(getattr(model, method, None)):
            setattr(model, method, _outputs_for_fsdp(getattr(model, method)))
            register_fsdp_forward_method(model, method)
            setattr(model, method, _first(getattr(model, method)))
    return model


def _outputs_for_fsdp(method):
    """``method`` for FSDP's hooks to wrap: it returns ``(output, tensors)``, ``output`` with every tensor
    that is a view (``_base`` set) cloned, and ``tensors`` the flat tuple of ``output``'s tensors.

    FSDP2 registers its pre-backward hook (the all-gather before, and the reduce-scatter queued after,
    the backward) on the output's tensors that require grad. torch 2.11 finds them with
    ``torch.utils._pytree.tree_flatten``, for which a dataclass such as the drafts' ``DraftTrainOutput`` is
    one leaf: no hook, so no gradient ever reached the sharded parameters (``grad_norm`` 0.0, nothing
    learnt); the flat tuple beside it is found by every version. Cloning the views (small: hidden
    states, confidence logits, not the vocabulary logits; gradients flow through the clone) keeps newer
    versions from warning that an in-place op on a view would skip the hook."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        tensors = []

        def keep(t):
            t = t.clone() if t._base is not None else t
            tensors.append(t)
            return t

        return map_tensors(keep, method(*args, **kwargs)), tuple(tensors)

    return wrapped


def _first(method):
    """``method`` (the FSDP-wrapped :func:`_outputs_for_fsdp`) returning its output alone."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        return method(*args, **kwargs)[0]

    return wrapped


def state_dict_options(**kw):
    """``StateDictOptions(full_state_dict=True, **kw)``: whole (gathered) state dicts of a sharded draft."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)
