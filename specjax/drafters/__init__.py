"""Drafters: pure functions over a params pytree that propose trees for the target to verify."""
