"""furlong.train"""
