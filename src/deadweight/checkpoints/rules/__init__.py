"""The rules a checkpoint scan is judged by: DW4xx."""
