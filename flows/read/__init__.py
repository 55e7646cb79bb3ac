"""The read side: what the commands that look at a stored run compute from it, without training.
inspect_lib.py summarises a run's steps, stages and samples for `stagerl inspect` and `stagerl
show` (and opens the run a command names); plots.py draws the PNGs of `stagerl plot`;
length_stats.py measures token lengths and recommends max lengths and token budgets for `stagerl
stats`. They read the store through storage.run_view.RunView and never write a stage's files."""
