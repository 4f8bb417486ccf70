"""Which classic silent training bugs `deadweight run` catches, by which rule, at which
step, and at what per-step cost.

Each bug class is rebuilt small on CPU as the user code that has it, beside a healthy
twin that must stay quiet. The single-process cases run in this process under what
`deadweight run` installs (`GlobalWatch`: global optimizer hooks, the step-0 check, the
loss at `.backward()`), with no change to the loop; the report is rebuilt after every
optimizer step, so "step" is the first optimizer step after which a finding at warning
or error is in the report (0: the step-0 check, which runs inside the first step). The
two DDP cases run under `deadweight run -- torchrun --nproc_per_node=2` (gloo), where
the step is the first watched step the finding names.

Per-step cost: the healthy twin's loop timed plain and watched (no step-0 check, a
one-off), interleaved A B A B, the median of the paired ratios. These models are tiny
(a step is ~1 ms), so the ratio shows deadweight's fixed Python cost per step at its
worst; benchmarks/watch_overhead.py measures it on a realistic model.

    python benchmarks/silent_bugs.py [--json PATH] [--skip-ddp]

Runs in about 2-4 minutes on 2 cores. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deadweight.watching.global_watch import GlobalWatch
from deadweight.watching.step_monitor import MonitorConfig

STEPS = 60
COST_STEPS = 30
COST_PAIRS = 3


@dataclass
class Loop:
    """One training run: `step(i)` does everything the user's loop does at iteration i."""

    step: Callable[[int], None]
    steps: int = STEPS


@dataclass
class Case:
    name: str
    expected: str  # what deadweight should say, or "out of reach" with why
    build: Callable[[bool], Loop]  # build(bug) -> the loop; bug False: the healthy twin
    found: dict[str, Any] = field(default_factory=dict)


# -- small models -----------------------------------------------------------------------------


class Net(nn.Module):
    """An MNIST-sized MLP with dropout and BatchNorm."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width, bias=False)  # BatchNorm follows: a bias is redundant
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.relu(self.bn(self.fc1(x))))
        return self.head(F.relu(self.fc2(h)))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def plain_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    zero: bool = True,
    before: Callable[[int], None] | None = None,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    scheduler: Any = None,
) -> Loop:
    def step(i: int) -> None:
        if before is not None:
            before(i)
        x, y = batch(i)
        if zero:
            opt.zero_grad()
        out = model(x)
        loss = loss_of(out, y) if loss_of is not None else F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()

    return Loop(step)


# -- the bug classes ---------------------------------------------------------------------------


def incident_fused_norm(bug: bool) -> Loop:
    from deadweight.demos import fused_rmsnorm

    setup = fused_rmsnorm.make(diff=not bug)

    def step(i: int) -> None:
        setup.optimizer.zero_grad(set_to_none=True)
        setup.loss().backward()
        setup.optimizer.step()

    return Loop(step)


def incident_cancelled_scalar(bug: bool) -> Loop:
    from deadweight.demos import layer_scalar_drift

    if bug:
        setup = layer_scalar_drift.make_watchable()
    else:  # the fix: the cancelled scalar is frozen, the model otherwise the same
        setup = layer_scalar_drift.make_watchable()
        setup.last_scalar.requires_grad_(False)

    def step(i: int) -> None:
        setup.next_batch()
        setup.optimizer.zero_grad(set_to_none=True)
        setup.loss().backward()
        setup.optimizer.step()

    return Loop(step)


def missing_zero_grad(bug: bool) -> Loop:
    torch.manual_seed(0)
    model = Net()
    return plain_loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), zero=not bug)


def eval_mode(bug: bool) -> Loop:
    torch.manual_seed(0)
    model = Net()

    def before(i: int) -> None:
        if i % 10 == 5:
            model.eval()
            with torch.no_grad():
                model(batch(1000 + i)[0])  # validation
            if not bug:
                model.train()

    return plain_loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), before=before)


class WithAux(Net):
    def __init__(self, use_aux: bool) -> None:
        super().__init__()
        self.aux = nn.Linear(4, 4)
        self.use_aux = use_aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.aux(out) if self.use_aux else out


def unused_module(bug: bool) -> Loop:
    torch.manual_seed(0)
    model = WithAux(use_aux=not bug)
    loop = plain_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loop.steps = 40  # the smoke test
    return loop


def frozen_layer(bug: bool) -> Loop:
    """A fine-tuning script freezes everything, then unfreezes the layers to train and
    forgets one of them; the optimizer is built over every parameter."""
    torch.manual_seed(0)
    model = Net()
    model.requires_grad_(False)
    for layer in (model.fc1, model.head) if bug else (model.fc1, model.fc2, model.head):
        layer.requires_grad_(True)
    return plain_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def stale_optimizer(bug: bool) -> Loop:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if bug:
        model = Net()  # re-created (a reload, a new seed) after the optimizer was built
    return plain_loop(model, opt)


def lr_never_warms_up(bug: bool) -> Loop:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = 100

    def factor(step: int) -> float:
        # the bug: integer division, 0 until step 100 (the run is 60 steps)
        return float(step // warmup) if bug else min(1.0, (step + 1) / 10)

    return plain_loop(model, opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, factor))


def scaler_skips_every_step(bug: bool) -> Loop:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    if bug:  # one parameter's gradient overflows on every step (FACTS: inf under fp16)
        model.fc2.bias.register_hook(lambda g: g * float("inf"))

    def step(i: int) -> None:
        x, y = batch(i)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    return Loop(step)


def detached_loss(bug: bool) -> Loop:
    """The classic 'fix' for 'element 0 of tensors does not require grad'."""
    torch.manual_seed(0)
    model = Net()

    def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if bug:
            return F.cross_entropy(out.detach(), y).requires_grad_()
        return F.cross_entropy(out, y)

    return plain_loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), loss_of=loss_of)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def tied_weights_untied(bug: bool) -> Loop:
    """The vocabulary grows by new tokens: the user's resize replaces the embedding and
    forgets to tie the head again; the optimizer is built before the resize."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    new = nn.Embedding(40, 16)
    with torch.no_grad():
        new.weight[:32] = model.emb.weight
    model.emb = new
    if bug:
        model.head = nn.Linear(16, 40, bias=False)
        with torch.no_grad():
            model.head.weight[:32] = new.weight[:32]  # copied, not tied
    else:
        model.head = nn.Linear(16, 40, bias=False)
        model.head.weight = model.emb.weight
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # rebuilt after the resize

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 40, (8, 12), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()

    return Loop(step)


CASES = [
    Case("incident 1: fused RMSNorm with no backward", "DW101/DW102 at step 0; DW301",
         incident_fused_norm),
    Case("incident 2: layer scalar a norm cancels", "DW104/DW105 at step 0; DW302 later",
         incident_cancelled_scalar),
    Case("optimizer.zero_grad() missing", "DW311", missing_zero_grad),
    Case("model left in eval() after validation", "DW312", eval_mode),
    Case("a module registered but unused (40 steps)", "DW313", unused_module),
    Case("a layer frozen that should train", "out of reach: requires_grad=False is how "
         "freezing is spelled, so nothing tells a mistake from intent", frozen_layer),
    Case("optimizer over stale (re-created) parameters", "DW201/DW202 at step 0",
         stale_optimizer),
    Case("lr 0: a warm-up that never starts", "DW304; DW301 at 50", lr_never_warms_up),
    Case("GradScaler skipping every step", "DW304/DW305", scaler_skips_every_step),
    Case("detached loss (.detach().requires_grad_())", "DW313", detached_loss),
    Case("tied weights untied by a resize", "DW201 at step 0", tied_weights_untied),
]  # fmt: skip


# -- running under what `deadweight run` installs ---------------------------------------------


def watched(case: Case, bug: bool) -> dict[str, Any]:
    """{code: first step it was in the report} at warning or error; 0: the step-0 check."""
    torch.manual_seed(0)
    loop = case.build(bug)
    first: dict[str, int] = {}
    w = GlobalWatch(config=MonitorConfig(every=20), log=None, argv=None, loss=True, check=True)
    error = None
    try:
        for i in range(loop.steps):
            loop.step(i)
            _note(w, first, i + 1)
    except Exception as exc:  # the bug made the script fail loudly: not a silent bug
        error = f"{type(exc).__name__}: {exc}"[:120]
    finally:
        w.close()
    _note(w, first, loop.steps)
    return {"first": first, "error": error, "steps": loop.steps}


def _note(w: GlobalWatch, first: dict[str, int], step: int) -> None:
    for f in w.report().findings:
        if f.severity.value in ("warning", "error") and f.code not in first:
            first[f.code] = 0 if f.phase == "step 0" else step


def cost(case: Case) -> float:
    """Median over COST_PAIRS of (watched / plain) time of the healthy twin's loop."""
    ratios = []
    for _ in range(COST_PAIRS):
        times = []
        for watching in (False, True):
            loop = case.build(False)
            w = (
                GlobalWatch(config=MonitorConfig(every=20), log=None, argv=None, check=False)
                if watching
                else None
            )
            loop.step(0)  # warm-up outside the timing (the watch finds the optimizer here)
            start = time.perf_counter()
            for i in range(1, COST_STEPS + 1):
                loop.step(i)
            times.append(time.perf_counter() - start)
            if w is not None:
                w.close()
        ratios.append(times[1] / times[0])
    return statistics.median(ratios)


# -- the DDP cases: two ranks under `deadweight run -- torchrun` -------------------------------

DDP_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
case, bug = sys.argv[1], sys.argv[2] == "bug"
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
model = DDP(net)
if case == "moved" and bug:
    # parameters replaced after wrapping: DDP keeps syncing the old tensors
    net[2] = nn.Linear(16, 1)
    torch.manual_seed(rank)  # each rank's new layer starts different, as on real devices
    nn.init.normal_(net[2].weight)
opt = torch.optim.SGD(net.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
for step in range(45):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    # the bug: the bare module on odd steps (an eval-style helper reused for training)
    forward = net if (case == "bare" and bug and step % 2) else model
    F.mse_loss(forward(x), y).backward()
    opt.step()
dist.destroy_process_group()
"""


def ddp_case(case: str, bug: bool) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(DDP_SCRIPT))
        command = [
            sys.executable, "-m", "deadweight", "run", "--every", "5", "--format", "json",
            "--log", os.path.join(tmp, "run.jsonl"), "--",
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={port}", script, case,
            "bug" if bug else "ok",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DEADWEIGHT_COLLECTIVE_TIMEOUT": "60"}
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    try:
        findings = json.loads(result.stdout)["findings"]
    except (json.JSONDecodeError, KeyError):
        return {"first": {}, "error": result.stderr.strip().splitlines()[-1:], "steps": 45}
    first: dict[str, Any] = {}
    for f in findings:
        if f["severity"] in ("warning", "error") and f["code"] not in first:
            ev = f.get("evidence", {})
            first[f["code"]] = 0 if f.get("phase") == "step 0" else ev.get("first_step", "end")
    return {"first": first, "error": None, "steps": 45}


DDP_CASES = [
    ("DDP model used bare on some steps (2 ranks)", "DW308", "bare"),
    ("parameters replaced after DDP wrapping (2 ranks)", "DW308", "moved"),
]

OUT_OF_SCOPE = [
    ("data-pipeline bugs (a bad augmentation, a shuffle that leaks, a wrong "
     "normalization of inputs)", "the parameters learn what they are shown; nothing in "
     "the model or optimizer is wrong"),
    ("wrong labels, or labels misaligned with inputs",
     "only a held-out metric can tell; every parameter trains normally"),
    ("hangs and deadlocks (mismatched collectives, a dataloader worker stuck)",
     "loud, not silent: the run stops; deadweight watches runs that go on"),
    ("a wrong loss (softmax before CrossEntropyLoss, a wrong reduction)",
     "gradients flow and parameters move; the objective itself is the bug"),
    ("hyper-parameters that are valid but poor (lr too high, too little decay)",
     "training behaves as configured; tuning is not a silent bug"),
    ("evaluation bugs (a metric computed wrongly, the wrong checkpoint evaluated)",
     "outside training; `deadweight diff` compares checkpoints, not metrics"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every raw result here")
    parser.add_argument("--skip-ddp", action="store_true", help="leave out the 2-rank cases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = []
    for case in CASES:
        bug, twin = watched(case, True), watched(case, False)
        ratio = cost(case)
        rows.append((case.name, case.expected, bug, twin, f"{ratio:.2f}x"))
    if not args.skip_ddp:
        for name, expected, key in DDP_CASES:
            bug, twin = ddp_case(key, True), ddp_case(key, False)
            rows.append((name, expected, bug, twin, "see watch_ddp_overhead.py"))
    print("| bug class | caught | rule(s) at step | healthy twin | per-step cost |")
    print("|---|---|---|---|---|")
    for name, _, bug, twin, ratio in rows:
        codes = ", ".join(f"{c} @ {s}" for c, s in sorted(bug["first"].items(), key=_order))
        caught = "yes" if bug["first"] else ("loud" if bug["error"] else "no")
        quiet = "quiet" if not twin["first"] else "NOT quiet: " + ", ".join(twin["first"])
        if bug["error"]:
            codes = f"raises {bug['error']}" + (f"; {codes}" if codes else "")
        print(f"| {name} | {caught} | {codes or '-'} | {quiet} | {ratio} |")
    print()
    print("Out of scope:")
    for what, why in OUT_OF_SCOPE:
        print(f"- {what}: {why}")
    cpu = os.times()
    print(
        f"\n(total {time.perf_counter() - started:.0f} s wall, "
        f"{cpu.user + cpu.system + cpu.children_user + cpu.children_system:.0f} s CPU)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"case": r[0], "expected": r[1], "bug": r[2], "twin": r[3],
                        "cost": r[4]} for r in rows], f, indent=1)  # fmt: skip


def _order(item: tuple[str, Any]) -> tuple[int, str]:
    step = item[1]
    return (step if isinstance(step, int) else 10**9, item[0])


if __name__ == "__main__":
    main()
