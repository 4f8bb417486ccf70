"""torch.distributed: ranks, collectives, replicas, and the cross-rank rules."""
