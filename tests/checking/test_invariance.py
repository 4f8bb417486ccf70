"""The gradient statistics a check takes, against a slow per-tensor reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deadweight
from deadweight.checking import flow_measurement, invariance


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, gradient, parameter): the dtypes a model trains in, and the gradients
    the exact-zero test must tell apart."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in ((), (1,), (7,), (5, 3), (2, 3, 4)):
            theta = torch.randn(shape, generator=g).to(dtype)
            grad = torch.randn(shape, generator=g).to(dtype)
            cases.append((f"{dtype} {shape}", grad, theta))
    theta = torch.randn(6, generator=g)
    tiny = torch.zeros(6)
    tiny[3] = 1e-30  # its square underflows float32: the norm is 0, the gradient is not
    negative_zero = torch.full((6,), -0.0)
    nan = torch.zeros(6)
    nan[2] = float("nan")
    inf = torch.zeros(6)
    inf[1] = float("inf")
    cases += [
        ("all zero", torch.zeros(6), theta),
        ("negative zeros", negative_zero, theta),
        ("one tiny entry", tiny, theta),
        ("subnormal", torch.full((6,), 1e-45), theta),
        ("nan", nan, theta),
        ("inf", inf, theta),
        ("empty", torch.zeros(0), torch.zeros(0)),
        ("zero parameter", torch.randn(6, generator=g), torch.zeros(6)),
    ]
    return cases


def _reference(grad: torch.Tensor, theta: torch.Tensor) -> tuple[float, float, float, float, bool]:
    """|g|, |theta|, <g, theta>, sum g in float64, one tensor at a time, and whether
    every entry of g is exactly 0."""
    g, t = grad.double(), theta.double()
    return (
        g.norm().item(),
        t.norm().item(),
        (g * t).sum().item(),
        g.sum().item(),
        not bool((grad != 0).any()),
    )


def _close(a: float, b: float, scale: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return abs(a - b) <= 1e-5 * scale + 1e-30


def _taken() -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list, list, list, list]:
    """The cases, their gradients and parameters, and their norms and sums as taken."""
    cases = _cases()
    grads = [g for _, g, _ in cases]
    params = [t for _, _, t in cases]
    return (
        cases,
        grads,
        params,
        invariance.gradient_norms(grads, params),
        invariance.gradient_sums(grads, params),
    )


def test_norms_and_sums_match_the_per_tensor_reference() -> None:
    cases, _, _, norms, sums = _taken()
    for (label, grad, theta), n, (dot, total) in zip(cases, norms, sums, strict=True):
        gnorm, pnorm, rdot, rsum, zero = _reference(grad, theta)
        assert n.exact_zero is zero, label
        assert _close(n.grad_norm, gnorm, gnorm), label
        assert _close(n.param_norm, pnorm, pnorm), label
        products = (grad.double() * theta.double()).abs().sum().item()
        assert _close(dot, rdot, products), label
        assert _close(total, rsum, grad.double().abs().sum().item()), label


def test_float64_entries_too_small_for_float32_are_not_an_exact_zero() -> None:
    tiny = torch.zeros(5, dtype=torch.float64)
    tiny[2] = 1e-300  # 0 in float32, and its square is 0 in float64
    (n,) = invariance.gradient_norms([tiny], [torch.ones(5, dtype=torch.float64)])
    assert not n.exact_zero
    (zero,) = invariance.gradient_norms([torch.zeros(5, dtype=torch.float64)], [tiny])
    assert zero.exact_zero


def _sparse_grad(rows: list[int], width: int, dtype: torch.dtype) -> torch.Tensor:
    """An nn.Embedding(sparse=True) gradient: rows of a 6-row table, repeats included
    (they add up when coalesced)."""
    g = torch.Generator().manual_seed(len(rows))
    values = torch.randn(len(rows), width, generator=g).to(dtype)
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, (6, width), check_invariants=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_sparse_gradient_is_read_from_its_stored_entries(dtype: torch.dtype) -> None:
    theta = torch.randn(6, 3, generator=torch.Generator().manual_seed(5)).to(dtype)
    grads = [_sparse_grad([0, 2, 2, 5], 3, dtype), _sparse_grad([], 3, dtype)]
    norms = invariance.gradient_norms(grads, [theta, theta])
    sums = invariance.gradient_sums(grads, [theta, theta])
    for grad, n, (dot, total) in zip(grads, norms, sums, strict=True):
        gnorm, pnorm, rdot, rsum, zero = _reference(grad.to_dense(), theta)
        assert n.exact_zero is zero
        assert _close(n.grad_norm, gnorm, gnorm) and _close(n.param_norm, pnorm, pnorm)
        scale = (grad.to_dense().double() * theta.double()).abs().sum().item()
        assert _close(dot, rdot, scale)
        assert _close(total, rsum, grad.to_dense().double().abs().sum().item())
    assert norms[1].exact_zero and sums[1] == (0.0, 0.0)


def test_a_complex_parameter_is_read_as_its_real_and_imaginary_parts() -> None:
    theta = torch.tensor([1 + 2j, -1j, 3, 0.5 - 0.5j], dtype=torch.complex64)
    imaginary = torch.tensor([1j, -2j, 0.5j, 0j], dtype=torch.complex64)
    (n,), ((dot, total),) = (
        invariance.gradient_norms([imaginary], [theta]),
        invariance.gradient_sums([imaginary], [theta]),
    )
    assert not n.exact_zero  # its real part alone is 0
    assert n.grad_norm == pytest.approx(torch.linalg.vector_norm(imaginary).item())
    assert n.param_norm == pytest.approx(torch.linalg.vector_norm(theta).item())
    parts_g, parts_t = torch.view_as_real(imaginary), torch.view_as_real(theta)
    assert dot == pytest.approx((parts_g * parts_t).sum().item())
    assert total == pytest.approx(parts_g.sum().item())
    sparse = imaginary.reshape(2, 2).to_sparse()
    ((sdot, stotal),) = invariance.gradient_sums([sparse], [theta.reshape(2, 2)])
    assert (sdot, stotal) == pytest.approx((dot, total))


class _Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).logsumexp(-1).mean()


class _Complex(nn.Module):
    """A complex weight whose gradient is purely imaginary at this point."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.w.imag * x).pow(2).mean()


def test_a_check_reads_sparse_and_complex_gradients() -> None:
    torch.manual_seed(0)
    lookup = _Lookup()
    ids = torch.tensor([1, 2, 3])
    assert not deadweight.check(lookup, lambda: lookup(ids)).findings
    complex_model = _Complex()
    x = torch.randn(8, 4)
    stats = flow_measurement.measure_grad_flow(complex_model, lambda: complex_model(x))
    w = next(p.grad for p in stats.params if p.name == "w")
    assert w is not None and not w.exact_zero and w.grad_norm > 0


def test_exact_zero_takes_the_largest_magnitude_of_zero_norm_gradients_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    largest = invariance._largest_magnitudes

    def counted(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(len(tensors))
        return largest(tensors)

    monkeypatch.setattr(invariance, "_largest_magnitudes", counted)
    healthy = [torch.randn(4) for _ in range(5)]
    invariance.gradient_norms(healthy, [torch.randn(4) for _ in range(5)])
    assert seen == []  # every norm above 0: nothing more to look at
    tiny = torch.zeros(4)
    tiny[0] = 1e-30
    mixed = [*healthy, torch.zeros(4), tiny]
    norms = invariance.gradient_norms(mixed, [torch.randn(4) for _ in range(7)])
    assert seen == [2]
    assert [n.exact_zero for n in norms] == [False] * 5 + [True, False]


def test_grad_stats_takes_sums_only_where_wanted() -> None:
    cases, grads, params, norms, every = _taken()
    wanted = [k % 3 == 0 for k in range(len(cases))]
    stats = invariance.grad_stats(grads, params, norms, wanted)
    for k, (s, n, (dot, total)) in enumerate(zip(stats, norms, every, strict=True)):
        assert (s.grad_norm, s.param_norm, s.exact_zero) == (
            n.grad_norm,
            n.param_norm,
            n.exact_zero,
        )
        assert s.param_rms == n.param_norm / math.sqrt(max(params[k].numel(), 1))
        if wanted[k]:
            # the same kernels on the same tensors as over all of them: the same bits
            assert str(s.grad_dot_param) == str(dot) and str(s.grad_sum) == str(total)
        else:
            assert s.grad_dot_param is None and s.grad_sum is None
            with pytest.raises(ValueError, match="not taken"):
                s.scale_score(1.0)


def test_rows_one_transfer_or_one_per_row_agree() -> None:
    columns = [[torch.tensor(float(k)) for k in range(5)], [torch.tensor(-k / 3) for k in range(5)]]
    assert invariance._rows(columns, True) == invariance._rows(columns, False)
    assert invariance._rows([[], []], True) == []


class _Gated(nn.Module):
    """A zero-initialised gate: the layer before it gets an exactly zero gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.zeros(1))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.gate * self.inner(x)).pow(2).mean()


def test_a_check_takes_sums_for_zero_gradients_and_skips_them_for_the_rest() -> None:
    torch.manual_seed(0)
    model = _Gated()
    x = torch.randn(8, 4)
    stats = flow_measurement.measure_grad_flow(model, lambda: model(x))
    by_name = {p.name: p.grad for p in stats.params}
    for name in ("inner.weight", "inner.bias"):
        g = by_name[name]
        assert g is not None and g.exact_zero
        assert g.grad_dot_param == 0.0 and g.grad_sum == 0.0
    for name in ("gate", "out.weight", "out.bias"):
        g = by_name[name]
        assert g is not None and not g.exact_zero
        assert g.grad_dot_param is None and g.grad_sum is None
        assert g.grad_norm > 0


def test_sums_are_those_of_the_checked_backward_when_loss_fn_zeroes_gradients_in_place() -> None:
    """A pasted training step zeroes the gradients in place at each call; the confirming
    re-run of a cancellation calls it again. The evidence must be the checked backward's."""

    def evidence(zeroes: bool) -> dict[str, object]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        x, y = torch.randn(16, 4), torch.randn(16, 1)

        def loss_fn() -> torch.Tensor:
            if zeroes:
                model.zero_grad(set_to_none=False)
            return ((model(x) - y) ** 2).mean()

        report = deadweight.check(model, loss_fn)
        (finding,) = [f for f in report.findings if "0.bias" in f.params]
        return finding.evidence["params"]["0.bias"]  # type: ignore[index]

    plain, zeroing = evidence(False), evidence(True)
    assert plain["grad_dot_param"] != 0.0 and plain["grad_sum"] != 0.0
    for key in ("grad_norm", "grad_dot_param", "grad_sum"):
        assert zeroing[key] == plain[key], key
