"""furlong.checkpoint: atomic checkpoints, their verification before a run writes, and a run's save/resume order."""
