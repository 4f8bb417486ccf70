"""`deadweight.watch` and `deadweight run`: the monitor during training, judged by DW3xx."""
