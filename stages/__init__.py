"""stagerl stages."""
