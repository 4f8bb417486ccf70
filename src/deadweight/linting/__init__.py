"""`deadweight lint`: the Python and Rust source scanners, judged by DW5xx."""
