"""Target decoders as pure functions: layers, the static KV cache, and the model."""
