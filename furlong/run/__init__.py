"""furlong.run: an RL run's wiring: input checks, set-up, the step's stages, the loop, its outputs."""
