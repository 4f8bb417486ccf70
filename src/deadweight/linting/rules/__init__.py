"""The rules source code is judged by: DW5xx."""
