"""Homologous names: the same parameter in different layers."""

from __future__ import annotations

import pytest

from deadweight.homologous import homologous_groups, layer_key


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("blocks.3.layer_scalar", ("blocks.{}.layer_scalar", 3)),
        ("transformer.h.11.ln_1.weight", ("transformer.h.{}.ln_1.weight", 11)),
        ("model.layers.2.experts.5.w1", ("model.layers.2.experts.{}.w1", 5)),  # the last index
        ("fc1.weight", None),  # a digit inside a word is no layer index
        ("conv2d.bias", None),
        ("0.weight", ("{}.weight", 0)),  # nn.Sequential
        ("Generator:net.0.weight", ("Generator:net.{}.weight", 0)),
    ],
)
def test_layer_key(name: str, key: tuple[str, int] | None) -> None:
    assert layer_key(name) == key


def test_groups_need_three_members() -> None:
    names = [f"h.{i}.ln.weight" for i in range(4)] + ["a.0.w", "a.1.w", "head.weight"]
    groups = homologous_groups(names)
    assert list(groups) == ["h.{}.ln.weight"]
    assert [i for i, _ in groups["h.{}.ln.weight"]] == [0, 1, 2, 3]


def test_groups_sorted_by_layer_index_not_text() -> None:
    names = [f"blocks.{i}.s" for i in (10, 2, 1)]
    assert [n for _, n in homologous_groups(names)["blocks.{}.s"]] == [
        "blocks.1.s", "blocks.2.s", "blocks.10.s",
    ]  # fmt: skip


def test_literal_braces_in_names_are_text() -> None:
    """A checkpoint can name its tensors `{}{}...`: the template keeps them as they are,
    the index is the one numeric component, and an all-digit name of 40 digits is no
    index at all (more than MAX_INDEX_DIGITS: a name, not a layer number)."""
    braces = "{}" * 24
    names = [f"{braces}.{i}.s" for i in range(4)] + ["1" * 40]
    assert layer_key(names[2]) == (f"{braces}.{{}}.s", 2)
    assert layer_key("1" * 40) is None
    assert layer_key("1" * 18) == ("{}", int("1" * 18))
    groups = homologous_groups(names)
    assert list(groups) == [f"{braces}.{{}}.s"]
    assert [n for _, n in groups[f"{braces}.{{}}.s"]] == names[:4]


def test_siblings_are_of_one_shape() -> None:
    """wav2vec2's first conv (1 input channel, kernel 10) is no sibling of the next two
    (16 channels, kernel 3): its RMS differs by its init alone."""
    shapes = {
        "fe.conv_layers.0.conv.weight": (16, 1, 10),
        "fe.conv_layers.1.conv.weight": (16, 16, 3),
        "fe.conv_layers.2.conv.weight": (16, 16, 3),
        "blocks.0.w": (4, 4),
        "blocks.1.w": (4, 4),
        "blocks.2.w": (4, 4),
        "blocks.3.w": (8, 4),
    }
    groups = homologous_groups(shapes, shapes.__getitem__)
    assert "fe.conv_layers.{}.conv.weight" not in groups
    assert [n for _, n in groups["blocks.{}.w"]] == ["blocks.0.w", "blocks.1.w", "blocks.2.w"]
    assert len(homologous_groups(shapes)["fe.conv_layers.{}.conv.weight"]) == 3  # names alone
