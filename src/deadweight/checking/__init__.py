"""`deadweight.check`: one forward and backward of a live model, judged by DW1xx/DW2xx."""
