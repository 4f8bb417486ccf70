"""The rules a watch is judged by: DW3xx."""
