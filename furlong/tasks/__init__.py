"""furlong.tasks"""
