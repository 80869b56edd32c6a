"""Engine-level A/B: stock serving engine vs the specialized path, through its HTTP API."""
