"""The adversarial corpus: one package per attack on the add+RMSNorm scope (see ../corpus.py).

Each attack is its own package so the static pre-screen of one (which reads the files beside its
entry point) never reports another's constructs.
"""
