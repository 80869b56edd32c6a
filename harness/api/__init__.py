"""The HTTP API (FastAPI, under /v1) and, later, the dashboard pages."""
