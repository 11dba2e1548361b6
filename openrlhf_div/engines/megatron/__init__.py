"""Megatron-core tensor-parallel policy / reference actors (filled in below)."""
