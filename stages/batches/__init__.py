"""How rows are grouped: over ranks (verl's balance_batch) and into micro-batches (one meaning for
every forward pass: logprob, update, reward model), and their collation.
"""
