"""Where a finding about a group of parameters points: a module that holds them all."""

from __future__ import annotations

from deadweight.wording import module_of


def test_a_group_points_at_the_deepest_module_holding_all_of_it():
    # The case: a block's ln_2 and its MLP's Linears, cut off together.
    names = [
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1.mlp.c_fc.bias",
        "transformer.h.1.mlp.c_proj.weight",
        "transformer.h.1.ln_2.weight",
    ]
    assert module_of(names).module == "transformer.h.1"
    assert module_of(names[:2]).module == "transformer.h.1.mlp.c_fc"
    assert module_of("transformer.h.1.ln_2.weight").module == "transformer.h.1.ln_2"


def test_parameters_of_several_models_list_them_and_many_name_the_root():
    assert module_of(["Generator:net.0.weight", "Discriminator:net.0.weight"]).module == (
        "Generator:net, Discriminator:net"
    )
    assert module_of(["a.w", "b.w", "c.w", "d.w"]).module == ""  # shown as <root>
    assert module_of(["scale", "h.0.w"]).module == ""  # one of them is the root's own
