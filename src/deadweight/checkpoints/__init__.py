"""Checkpoint forensics: readers of every format, the streaming scan, DW4xx."""
