"""The RL algorithms as pure torch (this project's core_algos): advantage estimators, policy and
value losses, KL estimators and controllers, rollout correction, DAPO's dynamic sampling. One file
per extension point, its registry at the top. A leaf: imports no stages/ module outside algos/
(configs/ imports it to validate and plan).
"""
