"""furlong.rewards"""
