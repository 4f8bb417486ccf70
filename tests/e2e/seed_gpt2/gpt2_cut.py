"""The seeded bug: the last block's MLP output is detached, so that block's ln_2 and
its MLP's two Linears (6 parameters) never get a gradient."""


def seed(modeling):
    block_init, mlp_forward = modeling.GPT2Block.__init__, modeling.GPT2MLP.forward

    def init(self, config, layer_idx=None):
        block_init(self, config, layer_idx=layer_idx)
        self.mlp.seeded_cut = layer_idx == config.n_layer - 1

    def forward(self, hidden_states):
        out = mlp_forward(self, hidden_states)
        if self.seeded_cut:
            out = out.detach()  # the seeded cut
        return out

    modeling.GPT2Block.__init__ = init
    modeling.GPT2MLP.forward = forward
