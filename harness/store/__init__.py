"""Persistence: SQLAlchemy models (models.py), sessions (db.py), every query (repositories.py)."""
