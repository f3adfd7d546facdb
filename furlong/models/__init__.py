"""furlong.models"""
