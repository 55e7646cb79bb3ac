"""Reward scoring: the rule scorers by data_source, custom reward functions, and the scorer
processes that live for a run.
"""
