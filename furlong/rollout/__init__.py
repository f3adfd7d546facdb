"""furlong.rollout"""
