"""The local engine: one process, a Hugging Face causal LM on CPU (or one GPU).

* :mod:`.tiny` builds real tiny HF models and tokenizers from a config (no hub needed)
* :mod:`.generation` batched KV-cache sampling and the training forward
  (:func:`sequence_log_probs`)
"""
