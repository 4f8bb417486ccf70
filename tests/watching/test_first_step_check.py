"""`deadweight run`'s step-0 check (watching/first_step_check.py) against `deadweight.check` on the
same model and batch, side by side, in-process through the zero-code watch itself.

Where the loss comes out of the model's forward the step-0 check is `check` with the
same loss: the same findings. Where it is computed outside, the check replays the
forward with a stand-in loss and keeps what holds for any loss computed from the
output: the same DW101/DW102/DW2xx, and the DW104/DW105 the graph's structure proves.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.demos import fused_rmsnorm, layer_scalar_drift
from deadweight.watching.first_step_check import locate
from deadweight.watching.global_watch import GlobalWatch
from deadweight.watching.step_monitor import MonitorConfig
from deadweight.watching.watcher import report_from_stats
from tests.e2e import seeded

STEPS = 3


def zero_code(loop: Callable[[], None]) -> deadweight.Report:
    """The report `deadweight run` would print for `loop` (its watch, in-process)."""
    gc.collect()  # other tests' optimizers, still alive, would make it name by class
    watch = GlobalWatch(config=MonitorConfig(every=1), log=None, argv=[], check=True)
    try:
        loop()
    finally:
        watch.close()
    return report_from_stats(watch.stats)


def facts(findings: Any) -> set[tuple[str, tuple[str, ...], str | None]]:
    """What must agree: the rule, its parameters and where it points."""
    return {
        (f.code, tuple(sorted(f.params)), str(f.location) if f.location else None) for f in findings
    }


def step0(report: deadweight.Report) -> list[deadweight.Finding]:
    return [f for f in report.findings if f.phase == "step 0"]


# -- where the loss is found --------------------------------------------------------


def test_the_loss_is_found_in_the_output_and_behind_scalings_of_it() -> None:
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    out = {"logits": w * 3, "loss": loss}
    assert locate(loss, out) == (("loss",), True)
    assert locate(loss / 4, out) == (("loss",), True)  # gradient accumulation
    assert locate(loss.float() * 1024.0, out) == (("loss",), True)  # a scaler's scale
    assert locate(loss, (out["logits"], loss)) == ((1,), True)


def test_a_loss_computed_from_the_output_points_at_the_tensor_it_came_from() -> None:
    w = torch.ones(3, 4, requires_grad=True)
    logits = w * 3
    loss = F.cross_entropy(logits, torch.tensor([0, 1, 2]))
    assert locate(loss, (logits,)) == ((0,), False)
    other = (torch.ones(2, requires_grad=True) * 2).sum()
    assert locate(other, (logits,)) is None  # from another forward altogether


# -- side by side with deadweight.check --------------------------------------------


def _in_model_loss_run(model: nn.Module, batches: list[torch.Tensor]) -> tuple[Any, Any]:
    opt = torch.optim.AdamW(seeded.decay_groups(model), lr=1e-3)
    first = batches[0]
    checked = deadweight.check(model, lambda: model(input_ids=first, labels=first).loss, opt)

    def loop() -> None:
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    return checked, zero_code(loop)


def test_a_scalar_before_the_final_norm_gives_the_same_findings_as_check() -> None:
    model = seeded.tiny_llama()
    name = seeded.scalar_before_final_norm(model)
    checked, report = _in_model_loss_run(model, seeded.batches(STEPS))
    assert report.subject["step0"]["mode"] == "replayed"
    assert facts(step0(report)) == facts(checked.findings)
    codes = {f.code for f in step0(report)}
    assert {"DW104", "DW203", "DW204"} <= codes
    assert all(name in f.params for f in step0(report) if f.code in ("DW104", "DW204"))


def test_frozen_embeddings_under_reentrant_checkpointing_give_the_same_findings() -> None:
    """The classic cut: reentrant checkpointing of layers whose input needs no gradient
    (the embedding is frozen) leaves every checkpointed layer without one."""
    model = seeded.tiny_llama()
    for layer in model.model.layers:  # reentrant, as transformers' own option once was
        forward = layer.forward

        def checkpointed(hidden: torch.Tensor, *args: Any, _f: Any = forward, **kwargs: Any) -> Any:
            run = functools.partial(_f, **kwargs)  # reentrant checkpoint takes no kwargs
            return torch.utils.checkpoint.checkpoint(run, hidden, *args, use_reentrant=True)

        layer.forward = checkpointed
    model.model.embed_tokens.requires_grad_(False)
    checked, report = _in_model_loss_run(model, seeded.batches(STEPS))
    assert report.subject["step0"]["mode"] == "replayed"
    assert facts(step0(report)) == facts(checked.findings)
    cut = [f for f in step0(report) if f.code == "DW101"]
    assert cut and all(p.startswith("model.layers.") for f in cut for p in f.params)


def _seed_side_by_side(setup: Any) -> tuple[deadweight.Report, deadweight.Report]:
    """`check` with a seed's own loss, then its training loop under the zero-code watch
    (the seeds' `loss()` draws the same first batch both times)."""
    checked = deadweight.check(setup.model, setup.loss, setup.optimizer)

    def loop() -> None:
        for _ in range(STEPS):
            setup.loss().backward()
            setup.optimizer.step()
            setup.optimizer.zero_grad()

    return checked, zero_code(loop)


def test_the_fused_kernel_seed_gives_check_s_cut_with_a_stand_in_loss() -> None:
    """Seed 1, whose loss (`F.mse_loss(model(x), y)`) is outside the model: the same cut,
    at the same line, as `check` with the real loss."""
    checked, report = _seed_side_by_side(fused_rmsnorm.make(False))
    assert report.subject["step0"]["mode"] == "structure-only"
    structural = [f for f in checked.findings if f.code.startswith(("DW101", "DW102", "DW2"))]
    assert facts(step0(report)) == facts(structural)
    (cut,) = [f for f in step0(report) if f.code == "DW102"]
    assert cut.location is not None and cut.location.function == "fused_rms_norm"


def test_the_drifting_scalar_seed_is_proven_by_structure_with_a_stand_in_loss() -> None:
    checked, report = _seed_side_by_side(layer_scalar_drift.make())
    assert report.subject["step0"]["mode"] == "structure-only"
    found = {f.code: f for f in step0(report)}
    expected = {f.code: f for f in checked.findings}
    assert "DW104" in found and set(found["DW104"].params) == set(expected["DW104"].params)
    assert "by construction" in found["DW104"].message
    assert {c for c in expected if c.startswith("DW2")} <= set(found)


def test_a_parameter_used_only_by_the_loss_outside_the_model_is_not_called_cut_off() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    temperature = nn.Parameter(torch.ones(1))
    model.register_parameter("temperature", temperature)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def loop() -> None:
        for _ in range(STEPS):
            F.cross_entropy(model(x) / temperature, y).backward()
            opt.step()
            opt.zero_grad()

    report = zero_code(loop)
    assert report.subject["step0"]["mode"] == "structure-only"
    assert not [f for f in step0(report) if "temperature" in f.params]


def test_a_healthy_run_adds_nothing_and_no_check_means_no_step_0() -> None:
    model = seeded.tiny_llama()
    checked, report = _in_model_loss_run(model, seeded.batches(STEPS))
    assert checked.findings == () and step0(report) == []
    watch = GlobalWatch(config=MonitorConfig(every=1), log=None, argv=[], check=False)
    try:
        model(input_ids=seeded.batches(1)[0], labels=seeded.batches(1)[0]).loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    finally:
        watch.close()
    assert "step0" not in report_from_stats(watch.stats).subject


@pytest.mark.parametrize("where", ["eval forward first", "no backward seen"])
def test_what_cannot_be_replayed_is_said_not_guessed(where: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop() -> None:
        with torch.no_grad():
            model(torch.randn(2, 4))  # an evaluation forward is never the one replayed
        if where == "no backward seen":  # gradients set by hand: nothing to replay
            for p in model.parameters():
                p.grad = torch.ones_like(p)
        else:
            model(torch.randn(2, 4)).sum().backward()
        opt.step()

    report = zero_code(loop)
    mode = report.subject["step0"]["mode"]
    assert mode == ("unavailable" if where == "no backward seen" else "structure-only")
    assert step0(report) == []


def test_a_drift_the_step_0_check_predicted_says_so() -> None:
    """Seed 2 under the zero-code watch: DW104 at step 0 (by the graph's structure),
    then DW302 while training, which names the prediction."""
    setup = layer_scalar_drift.make_watchable()
    report = zero_code(lambda: layer_scalar_drift.train(setup, 400, every=400))
    (cancelled,) = [f for f in step0(report) if f.code == "DW104"]
    (drift,) = report.by_code("DW302")
    assert drift.params == cancelled.params
    assert drift.evidence["predicted_at_step_0"] == "DW104"
    assert "Predicted at step 0 (DW104" in drift.message


# -- the log, and what shows the findings ---------------------------------------------


def _cut_model_run(tmp_path: Any) -> tuple[str, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    model[0].register_forward_hook(lambda _m, _i, out: out.detach())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = str(tmp_path / "run.jsonl")
    gc.collect()  # other tests' optimizers, still alive, would make it name by class
    watch = GlobalWatch(config=MonitorConfig(every=1), log=log, argv=[], check=True)
    try:
        for _ in range(STEPS):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        watch.close()
    return log, model


def test_the_log_keeps_the_step_0_findings_for_deadweight_report(tmp_path: Any) -> None:
    from deadweight.cli.report import load_log

    log, _ = _cut_model_run(tmp_path)
    ((report, _stats),) = load_log(log)
    first = step0(report)
    assert {f.code for f in first} == {"DW101", "DW102"}
    assert all(set(f.params) == {"0.weight", "0.bias"} for f in first)
    (cut,) = [f for f in first if f.code == "DW102"]
    assert cut.location is not None and __file__.endswith(str(cut.location.file))
    text = str(report)
    assert text.index("At step 0") < text.index("DW102") < text.index("While training")
    assert report.to_dict()["findings"][0]["phase"] == "step 0"


def test_html_and_notebook_show_step_0_in_its_own_section(tmp_path: Any) -> None:
    pytest.importorskip("plotly")
    from deadweight.cli.report import load_log
    from deadweight.report.html import Section, render_html

    log, _ = _cut_model_run(tmp_path)
    ((report, stats),) = load_log(log)
    page = render_html([Section("run.jsonl", report, stats)])
    section = page[page.index('class="step0"') :]
    assert "At step 0" in section and "DW102" in section[: section.index("While training")]
    assert "run.jsonl · step 0" in page
    notebook = report._repr_html_()
    assert notebook.index("At step 0") < notebook.index("DW102") < notebook.index("While training")


def test_a_forged_step_0_finding_is_left_out_and_said(tmp_path: Any) -> None:
    import json

    from deadweight.cli.report import load_log

    log, _ = _cut_model_run(tmp_path)
    lines = Path(log).read_text().splitlines()
    events = [json.loads(line) for line in lines]
    (check,) = [e for e in events if e["event"] == "check"]
    check["findings"].append({"code": "DW101", "name": "no-gradient", "severity": "fatal"})
    check["findings"].append({"code": ["not", "text"]})
    with open(log, "w") as fh:
        fh.write("\n".join(json.dumps(e) for e in events) + "\n")
    ((report, _),) = load_log(log)
    assert {f.code for f in step0(report)} == {"DW101", "DW102"}  # the two real ones
    assert sum("step-0 finding was left out" in p for p in report.subject["problems"]) == 2


def test_the_check_s_own_backward_is_neither_a_loss_nor_a_backward_of_the_script() -> None:
    model = seeded.tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gc.collect()
    watch = GlobalWatch(config=MonitorConfig(every=1), log=None, argv=[], check=True)
    try:
        for ids in seeded.batches(STEPS):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        watch.close()
    assert watch.stats.step0_mode == "replayed"
    assert watch.backwards == STEPS
    assert len(watch.stats.loss_values) == STEPS


# -- pipelines: several outermost modules called in turn (issue 31) --------------------------


class _Encoder(nn.Module):
    def __init__(self, cut: bool = False, variational: bool = False) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 16)
        self.mu = nn.Linear(16, 3)
        self.log_var = nn.Linear(16, 3) if variational else None
        self.cut, self.variational = cut, variational

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.hidden(x))
        if self.cut:
            h = h.detach()  # CUT IN THE ENCODER
        return (self.mu(h), self.log_var(h)) if self.variational else self.mu(h)


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in text and "_line(" not in text)  # fmt: skip


def _cut_in_encoder(report: deadweight.Report) -> None:
    """DW101 + DW102 on exactly the encoder's hidden layer, at the line that detaches."""
    found = {f.code: f for f in step0(report)}
    assert set(found) == {"DW101", "DW102"}, step0(report)
    for finding in found.values():
        assert set(finding.params) == {"_Encoder:hidden.weight", "_Encoder:hidden.bias"}
        assert finding.location is not None and finding.location.line == _line("CUT IN THE ENCODER")


@pytest.mark.parametrize("cut", [False, True], ids=["healthy", "cut"])
def test_an_encoder_then_a_decoder_are_replayed_together(cut: bool) -> None:
    """`z = enc(x); recon = dec(z)`: replaying the decoder alone would backward through
    the encoder's graph, freed by the script's own backward."""
    torch.manual_seed(0)
    enc, dec = _Encoder(cut), nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 6))
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-3)
    x = torch.randn(32, 6)

    def loop() -> None:
        for _ in range(STEPS):
            z = enc(x)
            F.mse_loss(dec(z), x).backward()
            opt.step()
            opt.zero_grad()

    report = zero_code(loop)
    assert report.subject["step0"]["mode"] == "structure-only", report.subject["step0"]
    if cut:
        _cut_in_encoder(report)
    else:
        assert step0(report) == []


def test_a_vae_with_the_sample_drawn_between_encoder_and_decoder() -> None:
    """The decoder's input is computed from the encoder's outputs by the script: the
    encoder's outputs join the stand-in loss, so its cut is still traced to its line."""
    torch.manual_seed(0)
    enc = _Encoder(cut=True, variational=True)
    dec = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 6))
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-3)
    x = torch.randn(32, 6)

    def loop() -> None:
        for _ in range(STEPS):
            mu, log_var = enc(x)
            z = mu + torch.exp(0.5 * log_var) * torch.randn_like(mu)
            kl = -0.5 * torch.mean(1 + log_var - mu.pow(2) - log_var.exp())
            (F.mse_loss(dec(z), x) + kl).backward()
            opt.step()
            opt.zero_grad()

    _cut_in_encoder(zero_code(loop))


def _at_lines(findings: Any) -> set[tuple[str, tuple[str, ...], Any]]:
    return {
        (
            f.code,
            tuple(sorted(f.params)),
            (f.location.file, f.location.line) if f.location else None,
        )
        for f in findings
    }


def _members_run(cut: bool) -> tuple[deadweight.Report, deadweight.Report]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    if cut:
        model[0].register_forward_hook(lambda _m, _i, out: out.detach())  # MEMBER CUT
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 6), torch.randint(0, 4, (32,))
    checked = deadweight.check(model, lambda: criterion(model(x), y), opt)

    def loop() -> None:
        for _ in range(STEPS):
            h = x
            for member in model:  # one by one, as a loop that logs each member does
                h = member(h)
            criterion(h, y).backward()
            opt.step()
            opt.zero_grad()

    return checked, zero_code(loop)


@pytest.mark.parametrize("cut", [False, True], ids=["healthy", "cut"])
def test_members_called_one_by_one_and_a_loss_module_replay_the_real_loss(cut: bool) -> None:
    """The loss is a loss module's output: the replay computes the script's own loss, so
    the findings are check's on the whole model with that loss."""
    checked, report = _members_run(cut)
    assert report.subject["step0"]["mode"] == "replayed"
    # The same rules, parameters and lines (check runs the model itself, the replay each
    # member: a module's own hook runs outside the module path for check alone).
    assert _at_lines(step0(report)) == _at_lines(checked.findings)
    assert bool(step0(report)) is cut
    if cut:
        (cut_at,) = [f for f in step0(report) if f.code == "DW102"]
        assert cut_at.location is not None and cut_at.location.line == _line("MEMBER CUT")


class _Generator(nn.Module):
    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 16)
        self.out = nn.Linear(16, 2)
        self.cut = cut

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(noise))
        return self.out(h.detach() if self.cut else h)  # CUT IN THE GENERATOR


@pytest.mark.parametrize(
    ("cut", "reuse"),
    [(False, False), (True, False), (True, True)],
    ids=["healthy", "cut", "cut, fake reused (DCGAN)"],
)
def test_a_gan_checks_each_optimizer_at_its_first_step(cut: bool, reuse: bool) -> None:
    """The discriminator's loss never reaches the generator (its samples are detached):
    the generator's cut is found at the generator's own first step."""
    torch.manual_seed(0)
    G = _Generator(cut)
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    bce = F.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)

    def loop() -> None:
        for _ in range(STEPS):
            real, noise = torch.randn(16, 2), torch.randn(16, 4)
            fake = G(noise)
            opt_d.zero_grad()
            (bce(D(real), ones) + bce(D(fake.detach()), zeros)).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(D(fake if reuse else G(noise)), ones).backward()
            opt_g.step()

    report = zero_code(loop)
    assert report.subject["step0"]["mode"] == "structure-only"
    if not cut:
        assert step0(report) == []
        return
    found = {f.code: f for f in step0(report)}
    assert set(found) == {"DW101", "DW102"}, step0(report)
    for finding in found.values():
        assert set(finding.params) == {"_Generator:first.weight", "_Generator:first.bias"}
        assert finding.location is not None
        assert finding.location.line == _line("CUT IN THE GENERATOR")


class _OnceOnly(nn.Module):
    """A forward that refuses to run twice on one batch (a stateful module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        # The batches themselves, not their ids: a freed batch's id is reused by the
        # next one at once, which made a fresh batch look seen, depending on what else
        # held on to the previous one.
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(x is t for t in self.seen):
            raise RuntimeError("this batch was already used")
        self.seen.append(x)
        return self.linear(x)


def test_where_no_replay_runs_the_first_backward_still_proves_the_cut() -> None:
    torch.manual_seed(0)
    model, aux = _OnceOnly(), nn.Linear(6, 2)
    opt = torch.optim.SGD([*model.parameters(), *aux.parameters()], lr=0.1)

    def loop() -> None:
        for _ in range(STEPS):
            x = torch.randn(8, 6)
            h = model(x)
            aux_out = aux(h)  # AUX HEAD, FORGOTTEN IN THE LOSS
            h.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            del aux_out

    report = zero_code(loop)  # the script ran to the end
    step0_info = report.subject["step0"]
    assert step0_info["mode"] == "from-backward", step0_info
    assert "the replay of the first forward failed" in step0_info["note"]
    found = {f.code: f for f in step0(report)}
    assert set(found) == {"DW101", "DW102"}
    for finding in found.values():
        assert set(finding.params) == {"Linear:weight", "Linear:bias"}
    assert found["DW102"].evidence["kind"] == "output-unused"
    assert found["DW102"].location.line == _line("AUX HEAD, FORGOTTEN")


def test_forwards_are_not_held_past_their_backward_nor_discarded_ones_piled_up() -> None:
    import weakref

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs: list[weakref.ref[torch.Tensor]] = []
    released: list[bool] = []

    def loop() -> None:
        for _ in range(5):  # an evaluation written without no_grad, before training
            refs.append(weakref.ref(model(torch.randn(2, 4))))
        out = model(torch.randn(2, 4))
        refs.append(weakref.ref(out))
        out.sum().backward()
        del out
        gc.collect()
        released.append(sum(r() is not None for r in refs) == 0)
        opt.step()

    zero_code(loop)
    assert released == [True]


def test_gradients_kept_outside_grad_prove_nothing_and_are_not_called_missing() -> None:
    """Megatron keeps gradients in `main_grad`: with no replay, a `.grad` of None on
    every parameter is no evidence of a cut, and nothing is reported from it."""
    torch.manual_seed(0)
    model = _OnceOnly()
    for p in model.parameters():

        def to_main_grad(p: torch.Tensor) -> None:
            p.main_grad = p.grad.clone()  # type: ignore[attr-defined,union-attr]
            p.grad = None

        p.register_post_accumulate_grad_hook(to_main_grad)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop() -> None:
        for _ in range(STEPS):
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()

    report = zero_code(loop)
    assert report.subject["step0"]["mode"] == "unavailable"
    assert "proves nothing either" in report.subject["step0"]["note"]
    assert step0(report) == []
