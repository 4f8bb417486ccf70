"""The rules `check` judges by: DW1xx (gradient flow) and DW2xx (optimizer audit)."""
