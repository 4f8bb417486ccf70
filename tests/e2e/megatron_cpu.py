"""megatron-core 0.16.1 on a CPU, for the end-to-end tests (tests/e2e/test_megatron.py).

megatron-core is installed without its dependencies (.ci/run) and runs its GPTModel,
its DDP and its mixed-precision optimizer on CPU under a one-process gloo group. What
it does on CUDA only is replaced here, each piece by name and no more:

- `GlobalMemoryBuffer.get_tensor` allocates its scratch buffer on CUDA: it returns a
  CPU tensor of the same shape and dtype instead.
- `CudaRNGStatesTracker.fork` switches to a CUDA RNG state (even at dropout 0): it
  forks nothing (every dropout here is 0).
- `DistributedDataParallel` allocates its gradient buffers on
  `torch.cuda.current_device()`: that returns "cpu" while it is built (`cpu_device`).
- `Float16OptimizerWithFloat16Params` and `FP32Optimizer` accept only parameters whose
  `Tensor.type()` names a CUDA type, and their constructors create one-element tensors
  with `device='cuda'`: while `get_megatron_optimizer` builds them
  (`cuda_types_on_cpu`), `type()` of a CPU tensor answers with the CUDA name of its
  dtype and `torch.tensor(device='cuda')` makes a CPU tensor.
- `ChainedOptimizer.get_grad_norm` allocates on CUDA: it returns 0.0. Nothing clips
  (`clip_grad=0.0`); the rest of every step runs unpatched.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB = 64
SEQ = 16
HIDDEN = 32
LAYERS = 3
HEADS = 4
# The final RMSNorm's epsilon against the hidden state's mean square decides how much of
# the layer scalar's gradient survives the cancellation. In the incident, eps = 1e-6
# against activations of order 1; this model's hidden state has a mean square of about
# 4e-4 (init std 0.02), so the same ratio takes an eps of about 1e-9. With Megatron's
# default 1e-5 the scalar keeps a real gradient of a third of its siblings'.
EPS = 1e-9
SCALAR = f"decoder.layers.{LAYERS - 1}.layer_scalar"


def start() -> None:
    """One gloo process, Megatron's parallel state at size 1, the two replacements."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.utils import GlobalMemoryBuffer

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)

    def get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, **_: Any) -> Any:
        return torch.empty(tensor_shape, dtype=dtype)

    GlobalMemoryBuffer.get_tensor = get_tensor
    # Its norm of all gradients allocates on CUDA; clip_grad is 0 here, so no clipping
    # reads it, and the step's return value (the norm, for logging) is 0.0.
    ChainedOptimizer.get_grad_norm = lambda self: 0.0
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": (
        contextlib.nullcontext()
    )


def transformer_config(bf16: bool = False) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def gpt(*, scalar: bool = False, bf16: bool = False, seed: int = 0) -> Any:
    """Megatron-core's GPTModel with its local RMSNorm layers, bf16 under Megatron's own
    `Float16Module` when asked. With `scalar`, the incident's model: each block's output
    is scaled by a shape-[1] layer scalar of its own (`decoder.layers.{i}.layer_scalar`);
    the last block's goes straight into the final RMSNorm, which cancels it.

    In bf16 the last block's scaled output is kept in fp32 and the final norm's output
    cast to bf16: Megatron's `fp32_residual_connection`, whose fused norms (Transformer
    Engine's, apex's) take fp32 input and give bf16 output, which the local spec's torch
    norms do not. Scaled in bf16, the cancelled scalar's gradient is bf16 rounding noise
    of random sign, about 1/400 of its siblings', and it random-walks instead of drifting.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    config = transformer_config(bf16)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    if scalar:
        layers = model.decoder.layers
        for layer in layers:
            layer.layer_scalar = nn.Parameter(torch.ones(1, dtype=config.params_dtype))
            last = layer is layers[-1]

            def scaled(module: nn.Module, _args: Any, output: Any, last: bool = last) -> Any:
                hidden, *rest = output
                if last and bf16:
                    hidden = hidden.float()
                return (hidden * module.layer_scalar, *rest)

            layer.register_forward_hook(scaled)
        if bf16:
            model.decoder.final_layernorm.register_forward_hook(
                lambda _m, _a, out: out.to(torch.bfloat16)
            )
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def batch(step: int, batch_size: int = 4) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(batch_size, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True: masked out
    return ids, positions, mask


def loss_of(model: Any, step: int) -> torch.Tensor:
    ids, positions, mask = batch(step)
    return model(ids, positions, mask, labels=ids).float().mean()


def optimizer_config(
    *, bf16: bool = False, distributed: bool = False, lr: float = 1e-3, wd: float = 0.1
) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=wd, bf16=bf16, clip_grad=0.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, use_distributed_optimizer=distributed,
    )  # fmt: skip


def megatron_adamw(
    model: Any, config: Any, overrides: dict[Any, Any] | None = None
) -> tuple[torch.optim.AdamW, Any]:
    """A torch AdamW over megatron-core's own parameter groups, and megatron-core's
    scheduler, which sets each group's weight_decay to wd × wd_mult (by default 0 for
    biases and every tensor with len(shape) == 1; `overrides` replace that rule)."""
    from megatron.core.optimizer import _get_param_groups

    groups = _get_param_groups([model], config, overrides)
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps
    )
    return optimizer, scheduler_for(optimizer, config)


def scheduler_for(optimizer: Any, config: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=config.lr, max_lr=config.lr, min_lr=config.lr,
        lr_warmup_steps=0, lr_decay_steps=10_000, lr_decay_style="constant",
        start_wd=config.weight_decay, end_wd=config.weight_decay,
        wd_incr_steps=10_000, wd_incr_style="constant",
    )  # fmt: skip


@contextlib.contextmanager
def cpu_device() -> Iterator[None]:
    """`torch.cuda.current_device()` is "cpu" inside (Megatron DDP's buffers)."""
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = current  # type: ignore[assignment]


def ddp(model: Any, *, distributed_optimizer: bool = False) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    with cpu_device():
        return DistributedDataParallel(model.config, ddp_config, model)


@contextlib.contextmanager
def cuda_types_on_cpu() -> Iterator[None]:
    type_, tensor = torch.Tensor.type, torch.tensor

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = type_(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    def cpu_tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]
    torch.tensor = cpu_tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.type = type_  # type: ignore[method-assign]
        torch.tensor = tensor  # type: ignore[assignment]


def megatron_optimizer(model: Any, config: Any) -> tuple[Any, Any]:
    """megatron-core's optimizer as `get_megatron_optimizer` builds it: a
    `ChainedOptimizer` around `Float16OptimizerWithFloat16Params` for a bf16 model (fp32
    main copies stepped by a torch AdamW, copied back into the bf16 parameters), its
    `DistributedOptimizer` with `use_distributed_optimizer` (the main copies are this
    rank's flat shards: with one rank, each whole parameter flattened), or
    `FP32Optimizer` for an fp32 one; and its scheduler (wd × wd_mult per group)."""
    from megatron.core.optimizer import get_megatron_optimizer

    with cuda_types_on_cpu(), cpu_device():
        optimizer = get_megatron_optimizer(config, [model])
    return optimizer, scheduler_for(optimizer, config)


# The two ways docs/megatron.md shows to decide decay by role with megatron-core's
# overrides (passing `config_overrides` replaces its standard rule, len(shape) == 1).


def role_overrides(model: nn.Module) -> dict[Any, Any]:
    from megatron.core.optimizer import ParamGroupOverride, ParamKey, ParamPredicate

    import deadweight

    exempt = {
        id(p)
        for group in deadweight.param_groups(model, weight_decay=1.0)
        if group["weight_decay"] == 0.0
        for p in group["params"]
    }
    by_role = ParamPredicate(name="deadweight_no_decay", fn=lambda p: id(p) in exempt)
    return {ParamKey(predicate=by_role): ParamGroupOverride(wd_mult=0.0)}


def tagged_overrides() -> dict[Any, Any]:
    from megatron.core.optimizer import ParamGroupOverride, ParamKey

    no_decay = ParamKey(name=("*.bias", "*layernorm.weight"), attr="_no_weight_decay")
    return {no_decay: ParamGroupOverride(wd_mult=0.0)}
