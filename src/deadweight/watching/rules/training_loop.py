"""DW311, DW312: how the training loop treats its optimizer's steps (watch statistics)."""

from __future__ import annotations

from collections.abc import Iterator

from deadweight.findings import Finding, Location, Severity
from deadweight.registry import get_rule, rule
from deadweight.watching.watch_stats import WatchStats
from deadweight.wording import module_of, name_list


@rule(
    code="DW311",
    name="gradients-not-zeroed",
    severity=Severity.ERROR,
    summary="An optimizer step consumed the gradient its previous step had already used.",
    consumes=WatchStats,
)
def gradients_not_zeroed(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Watches a few small parameters of each optimizer. After a step it notes which
    tensor `.grad` is and its version counter; at the first backward that reaches
    the parameter after the step, before the new gradient is added, `.grad` is still
    that tensor at that version only if nothing zeroed it, and then one small device
    reduction says whether the old gradient is non-zero. Later backwards before the
    next step look again (a loop may zero the gradients after another loss reached
    them, as a GAN's generator pass reaches the discriminator), and the next step
    settles it: it consumed a gradient that still held the previous step's. Healthy
    loops cost nothing on the device: `zero_grad(set_to_none=True)`,
    `model.zero_grad()` and `p.grad = None` leave None; `zero_grad(set_to_none=False)`
    bumps the version; gradient accumulation zeroes after the step. The HF Trainer,
    Lightning, Accelerate and DeepSpeed loops zero for you (DeepSpeed and FSDP2 keep
    gradients where this check does not look, and are not judged).

    ## Why is this bad
    Every backward adds to what `.grad` holds, so without `zero_grad()` step k
    applies the sum of the gradients of steps 1..k: the effective learning rate grows
    with every step, momentum and Adam's moments see a running sum, and the model
    follows where it has been rather than where the loss is. Nothing raises and the
    loss can fall for a while.

    ## Example
    ```python
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()            # no optimizer.zero_grad() anywhere in the loop
    ```

    ## Fix
    Call `optimizer.zero_grad()` (or `model.zero_grad()`) once per optimizer step:
    before the forward, or right after `optimizer.step()`. With gradient accumulation,
    zero after each step, not after each backward.

    ## Evidence
    - `step`: the first step that consumed a stale gradient.
    - `optimizer`: the optimizer's index in the watch.
    - `params`: the watched parameters whose stale gradient was seen.
    """
    for stale in stats.stale_grads:
        opt = stats.optimizers.get(stale.optimizer)
        cls = opt.cls if opt is not None else "the optimizer"
        yield get_rule("DW311").finding(
            f"Step {stale.step} of {cls} (optimizer {stale.optimizer}) consumed a gradient "
            "that still held the previous step's: nothing zeroed `.grad` between the two "
            f"steps, so gradients pile up across steps (seen on {name_list(stale.params)}).",
            params=stale.params,
            location=module_of(stale.params),
            evidence={"step": stale.step, "optimizer": stale.optimizer, "params": stale.params},
        )


@rule(
    code="DW312",
    name="trained-in-eval-mode",
    severity=Severity.WARNING,
    summary="Optimizer steps were taken with dropout or BatchNorm modules in eval mode.",
    consumes=WatchStats,
)
def trained_in_eval_mode(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Lists once, when watching begins, the modules of the model whose forward depends
    on `training`: dropout with p > 0 (`nn.Dropout*`, and modules that apply a float
    `dropout` or `layerdrop` rate themselves, as transformers' layers do), and
    BatchNorm / InstanceNorm that track running statistics. At every optimizer step
    it reads their `training` flags. When some are in eval mode it decides which
    matter:

    1. a module inside a frozen part put in eval on purpose is left out: the largest
       subtree in eval mode holding it has no trainable parameter (a frozen backbone,
       a frozen perceptual-loss network, a teacher inside the model);
    2. normalization layers in eval while the model's root module trains are left
       out: statistics frozen one by one on purpose (mmdetection's `norm_eval`, the
       usual detection fine-tuning setup);
    3. of the rest, a module counts once a forward with gradients enabled shows that
       something trainable is upstream of it or inside it (its input requires grad,
       or its own parameters are trainable).

    It reports the modules that count and the step from which they were in eval mode
    (and the step at which they trained again, if they did).

    ## Why is this bad
    A validation pass that calls `model.eval()` and never `model.train()` leaves
    every later step training a different model: dropout is off (the regularisation
    the run was tuned with is gone), BatchNorm normalises with stale running
    statistics and stops updating them, LayerDrop keeps every layer. Nothing raises;
    the training loss even looks better.

    ## Example
    ```python
    for step, (x, y) in enumerate(loader):
        if step % 100 == 5:
            model.eval()
            evaluate(model)          # and no model.train() after it
        loss = F.cross_entropy(model(x), y)
        ...
    ```

    ## Fix
    Call `model.train()` after every evaluation (or at the top of each training
    step). To freeze BatchNorm statistics on purpose, freeze the module's parameters
    too or keep its model's root in train mode; to run without dropout, set its `p`
    to 0.

    ## Evidence
    - `start`: the first optimizer step seen with the modules in eval mode.
    - `end`: the step at which they trained again (None: to the end of the watch).
    - `modules`: the modules that count (at most 64 named), `module_count` all of them.
    - `kinds`: `dropout`, `norm`, `layerdrop`.
    """
    seen: set[tuple[int, tuple[str, ...]]] = set()
    for episode in stats.eval_episodes:
        key = (episode.start, tuple(episode.modules))  # two optimizers over one model
        if key in seen:
            continue
        seen.add(key)
        span = (
            f"from step {episode.start} to step {episode.end}"
            if episode.end is not None
            else f"from step {episode.start} on"
        )
        kinds = " and ".join(episode.kinds) or "mode-dependent"
        yield get_rule("DW312").finding(
            f"{episode.module_count} {kinds} module(s) were in eval mode while the optimizer "
            f"stepped, {span} ({name_list(episode.modules)}): the model trained is not the "
            "one evaluated, and a model.train() is missing after an evaluation.",
            location=_modules_location(episode.modules),
            evidence={
                "start": episode.start,
                "end": episode.end,
                "modules": episode.modules,
                "module_count": episode.module_count,
                "kinds": episode.kinds,
            },
        )


def _modules_location(modules: list[str]) -> Location:
    # module_of takes parameter names: a module name with a dummy leaf is one
    return module_of([f"{m}.x" for m in modules])
