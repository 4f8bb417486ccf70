"""The cross-rank rules: DW108, DW207, DW308."""
