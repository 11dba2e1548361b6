"""Training engines. ``local``: one process, a Hugging Face model on CPU or one GPU."""
