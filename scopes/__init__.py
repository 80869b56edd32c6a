"""Scope manifests: the model (manifest.py) and the manifests themselves (*.yaml)."""
