"""What every drafter family's training shares: distilled data records, the NNX/Optax/Orbax
training loop, and evaluation by the real speculative loop."""
