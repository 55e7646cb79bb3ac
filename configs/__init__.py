"""stagerl configs."""
