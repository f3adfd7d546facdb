"""furlong.trainer: the FSDP2 trainers (actor, critic) and their mechanics: planning, packing, log-probs, optimizer, weight sync."""
