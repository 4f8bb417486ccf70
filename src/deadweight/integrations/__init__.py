"""Thin adapters over `deadweight.watch` for training frameworks and experiment trackers.

Each module is imported on its own and only then imports its framework, so
`import deadweight` never pulls in transformers, lightning, tensorboard or wandb:

    deadweight.integrations.transformers   DeadweightCallback (a TrainerCallback)
    deadweight.integrations.lightning      DeadweightCallback (a Lightning Callback)
    deadweight.integrations.forward        watch scalars and findings to TensorBoard or W&B
"""
