"""StepMonitor's numbers against a slow reference: a plain loop that copies everything."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deadweight
from deadweight.watching.event_log import read_log


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(6, 5)  # 30 + 5 elements: exact statistics
        self.big = nn.Linear(80, 60)  # 4800 elements: large
        self.scale = nn.Parameter(torch.ones(1))
        self.sometimes = nn.Parameter(torch.randn(5))  # a gradient on even steps only
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.scale * self.big(x)[:, :6]
        out = self.small(h)
        if step % 2 == 0:
            out = out + self.sometimes
        return out


def _train(model: Net, opt: torch.optim.Optimizer, steps: int, record: list | None = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 80, generator=gen)
        y = torch.randn(16, 5, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x, step) - y) ** 2).mean()
        loss.backward()
        before = {n: p.detach().clone().double() for n, p in model.named_parameters()}
        grads = {
            n: p.grad.detach().clone().double() if p.grad is not None else None
            for n, p in model.named_parameters()
        }
        opt.step()
        if record is not None:
            after = {n: p.detach().clone().double() for n, p in model.named_parameters()}
            record.append((before, grads, after))


@pytest.mark.parametrize("every", [1, 7])
def test_step_records_match_slow_reference(tmp_path, every: int) -> None:
    steps = 21
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record: list = []
    log = tmp_path / "run.jsonl"
    with deadweight.watch(model, opt, every=every, log=log, full=True):
        _train(model, opt, steps, record)
    events = read_log(log).events
    described = next(e for e in events if e["event"] == "optimizer")
    names = [p["name"] for p in described["params"]]
    assert "frozen" not in names
    records = [e for e in events if e["event"] == "step"]
    watched = [1, *range(every, steps + 1, every)]
    assert [r["step"] for r in records] == sorted(set(watched))
    last = records[-1]
    s = last["step"]
    window_start = records[-2]["step"] if len(records) > 1 else 0
    for pos, name in enumerate(names):
        before, _, after = record[s - 1]
        # param norm after the step, update norm of that step
        assert last["param_norm"][pos] == pytest.approx(after[name].norm().item(), rel=1e-6)
        assert last["update_norm"][pos] == pytest.approx(
            (after[name] - before[name]).norm().item(), rel=1e-5, abs=1e-12
        )
        # grad RMS over the steps of the window in which the gradient was present
        window = [record[k][1][name] for k in range(window_start, s)]
        present = [g for g in window if g is not None]
        if present:
            expected = math.sqrt(sum(g.norm().item() ** 2 for g in present) / len(present))
            assert last["grad_rms"][pos] == pytest.approx(expected, rel=1e-5)
        else:
            assert last["grad_rms"][pos] is None
        total_present = sum(1 for k in range(s) if record[k][1][name] is not None)
        assert last["grad_present"][pos] == total_present
        assert last["moved"][pos] is True

    # Exact small-parameter statistics, cumulative since the start
    for k, pos in enumerate(described["small"]):
        name = names[pos]
        path = sum((a[name] - b[name]).norm().item() for b, _, a in record[:s])
        radial = [((a[name] - b[name]) * b[name]).sum().item() for b, _, a in record[:s]]
        sens = sum(
            abs((g[name] * b[name]).sum().item()) for b, g, _ in record[:s] if g[name] is not None
        )
        gsum = sum(g[name].norm().item() for _, g, _ in record[:s] if g[name] is not None)
        drift = (record[s - 1][2][name] - record[0][0][name]).norm().item()
        assert last["small_path"][k] == pytest.approx(path, rel=1e-9)
        assert last["small_rpos"][k] == sum(1 for r in radial if r > 0)
        assert last["small_rneg"][k] == sum(1 for r in radial if r < 0)
        assert last["small_sens"][k] == pytest.approx(sens, rel=1e-9)
        assert last["small_gsum"][k] == pytest.approx(gsum, rel=1e-6)
        assert last["small_drift"][k] == pytest.approx(drift, rel=1e-9)
    assert "big.weight" not in [names[i] for i in described["small"]]
    # tiny parameters have their values logged
    logged = [names[i] for i in described["values"]]
    assert sorted(logged) == ["scale", "small.bias", "sometimes"]
    flat = [v for n in logged for v in record[s - 1][2][n].reshape(-1).tolist()]
    assert last["values"] == pytest.approx(flat, rel=1e-7)


def test_update_norms_round_robin_within_budget(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(10)])  # 10 large weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"
    with deadweight.watch(model, opt, every=1, log=log):  # default copy_fraction 0.1
        for _ in range(12):
            opt.zero_grad()
            model(torch.randn(4, 100)).pow(2).mean().backward()
            opt.step()
    events = read_log(log).events
    names = [p["name"] for p in next(e for e in events if e["event"] == "optimizer")["params"]]
    large = [i for i, n in enumerate(names) if n.endswith("weight")]
    seen: set[int] = set()
    for record in (e for e in events if e["event"] == "step"):
        measured = [i for i in large if record["update_norm"][i] is not None]
        assert len(measured) == 1  # 10% of the parameter bytes: one weight per watched step
        seen.update(measured)
    assert seen == set(large)  # and every one of them in turn


def test_nonfinite_first_step_and_param(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt, every=5) as w:
        for step in range(1, 13):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            if step == 7:
                model[1].weight.grad[0, 0] = float("nan")
            opt.step()
    found = w.report().by_code("DW305")
    assert len(found) == 1
    ev = found[0].evidence
    assert ev["first_step"] == 7
    assert ev["first_param"] == "1.weight"
    assert ev["first_kind"] == "grad"
    # The NaN went into the weight at that step; the value check sees it at the next record.
    assert ev["per_param"]["1.weight"]["value"] == 10


def test_reset_detected_for_new_optimizer_state_only(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()

    with deadweight.watch(model, opt, every=5) as w:
        for _ in range(10):
            step()
        opt.load_state_dict(opt.state_dict())  # keeps the state: not a reset
        for _ in range(5):
            step()
        opt.state.clear()
        for _ in range(25):
            step()
    resets = w.stats.resets
    assert [r.step for r in resets] == [16]
    assert sorted(resets[0].params) == ["bias", "weight"]
    assert resets[0].effect is not None  # measured over the burst after it


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_closure_steps_measure_this_steps_gradients(tmp_path, optimizer: str) -> None:
    """With optimizer.step(closure) backward runs inside step(): the grads measured must be
    the ones that step uses, not the previous step's."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    )
    used: list[float] = []
    log = tmp_path / "run.jsonl"
    with deadweight.watch(model, opt, every=1, log=log):
        for step in range(4):
            x = torch.full((2, 3), float(step + 1))

            def closure(x: torch.Tensor = x, step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                if len(used) == step:  # the first call of this step
                    used.append(model.weight.grad.norm().item())
                return loss

            opt.step(closure)
    records = [e for e in read_log(log).events if e["event"] == "step"]
    names = [
        p["name"]
        for p in next(e for e in read_log(log).events if e["event"] == "optimizer")["params"]
    ]
    weight = names.index("weight")
    assert [r["grad_rms"][weight] for r in records[:4]] == pytest.approx(used, rel=1e-6)
