"""stagerl flows."""
