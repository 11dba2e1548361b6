"""Training engines: local (one process), openrlhf (Ray topology), megatron (tensor-parallel actor)."""
