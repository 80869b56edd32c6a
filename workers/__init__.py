"""Celery workers and the child-process runner they launch evaluations through."""
