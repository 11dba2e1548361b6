"""Training engines: ``local`` (one process, a Hugging Face model on CPU or one GPU) and
``openrlhf`` (OpenRLHF 0.11.2's Ray topology: vLLM rollouts, DeepSpeed actors)."""
