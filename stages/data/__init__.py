"""The prompt dataset in verl's RL parquet schema: files read and checked, rows tokenised once per
run (Arrow cache), datasets built without a hub, ReMax's greedy baseline answers.
"""
