"""The diversity demo: the cached base model (warmup), evaluation helpers and the pipeline behind `openrlhf-div demo`."""
