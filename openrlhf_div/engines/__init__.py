"""Training engines: ``local`` (one process, a Hugging Face model on CPU or one GPU),
``openrlhf`` (OpenRLHF 0.11.2's Ray topology: vLLM rollouts, DeepSpeed actors) and
``megatron`` (a Megatron-core tensor-parallel policy/reference actor for that topology)."""
