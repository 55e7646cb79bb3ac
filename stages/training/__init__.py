"""What runs inside a rank during the update: the DeepSpeed engines, the trained roles (actor,
critic) and their losses, the training loop, and the train state in the store.
"""
