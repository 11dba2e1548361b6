"""The ``openrlhf-div`` command line."""
