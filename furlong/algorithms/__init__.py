"""furlong.algorithms: the algorithm math, pure functions checked against miles (estimators, shaping, losses, value loss)."""
