"""Healthy models produce no DW101 and no DW102, and agree with a plain-backward reference.

Each case builds a model and a `loss_of(model)` function; the test runs
`deadweight.check` on the model and `reference_no_grad` (plain `loss.backward()` on a
deep copy) and asserts that both name the same parameters: none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from tests.conftest import reference_no_grad
from tests.tiny_transformers import bert_config, gpt2_config

LossOf = Callable[[nn.Module], torch.Tensor]
Case = tuple[nn.Module, LossOf]


# -- plain PyTorch models ---------------------------------------------------------


def mlp() -> Case:
    model = nn.Sequential(
        nn.Linear(10, 32),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.LayerNorm(32),
        nn.Linear(32, 4),
    )
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    return model, lambda m: F.cross_entropy(m(x), y)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def cnn() -> Case:
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    return SmallCNN(), lambda m: F.cross_entropy(m(x), y)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, 16, d))
        layer = nn.TransformerEncoderLayer(
            d, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids) + self.pos[:, : ids.shape[1]]
        n = ids.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.encoder(h, mask=causal, is_causal=True, src_key_padding_mask=pad_mask)
        return self.out(self.norm(h))


def transformer() -> Case:
    ids = torch.randint(0, 50, (3, 12))
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, -3:] = True
    return TinyTransformer(), lambda m: F.cross_entropy(
        m(ids, pad)[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1)
    )


def transformer_layer_plain() -> Case:
    model = nn.Sequential(
        nn.Linear(8, 32),
        nn.TransformerEncoderLayer(
            32, nhead=2, dim_feedforward=48, batch_first=True, norm_first=True
        ),
        nn.Linear(32, 1),
    )
    x = torch.randn(2, 6, 8)
    return model, lambda m: m(x).pow(2).mean()


# -- transformers models, random-initialised from tiny configs --------------------


def _tokens(vocab: int = 100, batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


def gpt2() -> Case:
    from transformers import GPT2LMHeadModel

    config = gpt2_config()
    model = GPT2LMHeadModel(config)
    ids = _tokens()
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return model, lambda m: m(input_ids=ids, attention_mask=mask, labels=ids).loss


def bert() -> Case:
    from transformers import BertForSequenceClassification

    config = bert_config()
    model = BertForSequenceClassification(config)
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    labels = torch.tensor([0, 2])
    return (
        model,
        lambda m: m(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss,
    )


# -- deliberate stop-gradients ----------------------------------------------------


class LogsDetached(nn.Module):
    """A `.detach()` / `.item()` used only for logging statistics, never for the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.stats: dict[str, float] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        logged = h.detach()
        self.stats["act_norm"] = logged.norm().item()
        self.stats["dead"] = (logged == 0).float().mean().item()
        self.stats["w_norm"] = float(self.fc1.weight.detach().norm())
        return self.fc2(h)


def logging_detach() -> Case:
    x = torch.randn(4, 8)
    return LogsDetached(), lambda m: m(x).pow(2).mean()


class SimSiam(nn.Module):
    """BYOL/SimSiam-style: the target branch is detached, but from the same encoder."""

    def __init__(self, under_no_grad: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16)
        )
        self.predictor = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16))
        self.under_no_grad = under_no_grad

    def target(self, view: torch.Tensor) -> torch.Tensor:
        if self.under_no_grad:
            with torch.no_grad():
                return self.encoder(view)
        return self.encoder(view).detach()

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        p1 = self.predictor(self.encoder(v1))
        z2 = self.target(v2)
        return -F.cosine_similarity(p1, z2, dim=-1).mean()


def byol_detach() -> Case:
    v1, v2 = torch.randn(6, 8), torch.randn(6, 8)
    return SimSiam(), lambda m: m(v1, v2)


def byol_no_grad() -> Case:
    v1, v2 = torch.randn(6, 8), torch.randn(6, 8)
    return SimSiam(under_no_grad=True), lambda m: m(v1, v2)


def byol_symmetric() -> Case:
    v1, v2 = torch.randn(6, 8), torch.randn(6, 8)
    return SimSiam(), lambda m: m(v1, v2) + m(v2, v1)


class WithEmaTarget(nn.Module):
    """BYOL proper: a frozen EMA copy of the encoder provides the target."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.predictor = nn.Linear(16, 16)
        self.target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z2 = self.target(v2)
        return -F.cosine_similarity(self.predictor(self.online(v1)), z2, dim=-1).mean()


def byol_ema() -> Case:
    v1, v2 = torch.randn(6, 8), torch.randn(6, 8)
    return WithEmaTarget(), lambda m: m(v1, v2)


class StraightThrough(nn.Module):
    """A straight-through estimator: x + (q - x).detach() keeps the gradient of x."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        q = torch.round(h * 4) / 4
        return self.dec(h + (q - h).detach())


def straight_through() -> Case:
    x = torch.randn(4, 8)
    return StraightThrough(), lambda m: m(x).pow(2).mean()


# -- other healthy patterns that touch the tracer ---------------------------------


def gpt2_checkpointed() -> Case:
    model, loss_of = gpt2()
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    return model, loss_of


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def checkpoint_nonreentrant() -> Case:
    x = torch.randn(4, 16)  # does not require grad: fine without reentrancy
    return Checkpointed(), lambda m: m(x).pow(2).mean()


def frozen_backbone() -> Case:
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    return model, lambda m: F.cross_entropy(m(x), y)


class Shared(nn.Module):
    """One block applied twice (weight sharing across depth) and a tied output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.block = nn.Linear(16, 16)
        self.out = nn.Linear(16, 30, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        return self.out(h)


def shared_and_tied() -> Case:
    ids = torch.randint(0, 30, (2, 7))
    return Shared(), lambda m: F.cross_entropy(m(ids).reshape(-1, 30), ids.reshape(-1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, num_layers=2, batch_first=True, dropout=0.1)
        self.gru = nn.GRU(12, 8, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def recurrent() -> Case:
    x = torch.randn(3, 5, 6)
    return Recurrent(), lambda m: m(x).pow(2).mean()


def parametrized() -> Case:
    from torch.nn.utils import parametrizations

    model = nn.Sequential(
        parametrizations.weight_norm(nn.Linear(8, 16)),
        nn.ReLU(),
        parametrizations.spectral_norm(nn.Linear(16, 16)),
        nn.ReLU(),
        parametrizations.orthogonal(nn.Linear(16, 16)),
        nn.Linear(16, 1),
    )
    x = torch.randn(4, 8)
    return model, lambda m: m(x).pow(2).mean()


class _ClampGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad.clamp(-1, 1)


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_ClampGrad.apply(self.fc1(x)))


def custom_function() -> Case:
    x = torch.randn(4, 8)
    return WithFunction(), lambda m: m(x).pow(2).mean()


class GatedByMask(nn.Module):
    """A hard mask from a comparison / argmax (no derivative) that gates a live tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x)
        top = scores.argmax(-1, keepdim=True)
        mask = torch.zeros_like(scores).scatter(-1, top, 1.0)
        keep = (scores > scores.mean()).float()
        return (self.experts(x) * mask * keep).sum(-1) + scores.softmax(-1).max(-1).values


def gated_by_mask() -> Case:
    x = torch.randn(6, 8)
    return GatedByMask(), lambda m: m(x).pow(2).mean()


def metrics_in_loss_fn() -> Case:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    log: list[float] = []

    def loss_of(m: nn.Module) -> torch.Tensor:
        logits = m(x)
        log.append((logits.argmax(-1) == y).float().mean().item())
        log.append(logits.data.abs().max().item())
        log.extend(logits.detach().softmax(-1)[:, 0].tolist())
        _ = logits.detach().numpy().sum()
        return F.cross_entropy(logits, y)

    return model, loss_of


def multihead_attention() -> Case:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True)
            self.out = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, weights = self.attn(x, x, x, need_weights=True)
            return self.out(h).mean() + 0.0 * weights.detach().sum()

    x = torch.randn(2, 5, 16)
    return Attn(), lambda m: m(x)


CASES: dict[str, Callable[[], Case]] = {
    "mlp": mlp,
    "cnn-batchnorm2d": cnn,
    "transformer-encoder": transformer,
    "transformer-layer": transformer_layer_plain,
    "gpt2": gpt2,
    "llama": llama,
    "bert-seqcls": bert,
    "logging-detach": logging_detach,
    "byol-detach": byol_detach,
    "byol-no-grad": byol_no_grad,
    "byol-symmetric": byol_symmetric,
    "byol-ema": byol_ema,
    "straight-through": straight_through,
    "gpt2-checkpointed": gpt2_checkpointed,
    "checkpoint-nonreentrant": checkpoint_nonreentrant,
    "frozen-backbone": frozen_backbone,
    "shared-and-tied": shared_and_tied,
    "recurrent": recurrent,
    "parametrized": parametrized,
    "custom-function": custom_function,
    "gated-by-mask": gated_by_mask,
    "metrics-in-loss-fn": metrics_in_loss_fn,
    "multihead-attention": multihead_attention,
}


# Structural redundancies that are real findings, not false positives: a bias right
# before BatchNorm is cancelled by it (DW105 warning), and so is BERT's key bias,
# which adds the same number to every attention logit of a query (softmax removes it).
REDUNDANT_BIASES = {
    "cnn-batchnorm2d": {"features.0.bias", "features.4.bias"},
    "byol-detach": {"encoder.0.bias"},
    "byol-no-grad": {"encoder.0.bias"},
    "byol-symmetric": {"encoder.0.bias"},
}


def _is_known_redundancy(case_name: str, finding: deadweight.Finding) -> bool:
    if finding.code != "DW105":
        return False
    allowed = REDUNDANT_BIASES.get(case_name, set())
    return all(p in allowed or p.endswith("attention.self.key.bias") for p in finding.params)


def _unexpected(case_name: str, report: deadweight.Report) -> list[deadweight.Finding]:
    """Findings above info that are not one of the known structural redundancies."""
    return [
        f
        for f in report.findings
        if f.severity.rank > deadweight.Severity.INFO.rank
        and not _is_known_redundancy(case_name, f)
    ]


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    model, loss_of = CASES[request.param]()
    model.train()
    model._case_name = request.param  # type: ignore[assignment]
    return model, loss_of


def _dw101(report: deadweight.Report) -> set[str]:
    return {p for f in report.by_code("DW101") for p in f.params}


def test_no_dw101(case: Case) -> None:
    model, loss_of = case
    report = deadweight.check(model, lambda: loss_of(model))
    assert not report.by_code("DW101"), report


def test_no_dw102(case: Case) -> None:
    model, loss_of = case
    report = deadweight.check(model, lambda: loss_of(model))
    assert not report.by_code("DW102"), report


def test_nothing_above_info_but_structural_redundancies(case: Case) -> None:
    model, loss_of = case
    report = deadweight.check(model, lambda: loss_of(model))
    assert _unexpected(model._case_name, report) == [], report
    assert report.subject["training_mode"] is True
    assert report.subject["trainable"] == sum(1 for p in model.parameters() if p.requires_grad)


def test_agrees_with_plain_backward(case: Case) -> None:
    model, loss_of = case
    expected = reference_no_grad(model, loss_of)
    report = deadweight.check(model, lambda: loss_of(model))
    assert _dw101(report) == expected
    assert expected == set()


def test_optimizer_given_changes_nothing(case: Case) -> None:
    model, loss_of = case
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = deadweight.check(model, lambda: loss_of(model), opt)
    assert _unexpected(model._case_name, report) == [], report
    assert report.subject["optimizer"] == "AdamW"
    assert not opt.state
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_optimizer_step_in_backward_is_not_no_gradient() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x = torch.randn(3, 4)
    report = deadweight.check(model, lambda: model(x).pow(2).mean())
    assert not report.by_code("DW101"), report
