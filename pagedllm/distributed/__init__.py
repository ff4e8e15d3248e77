"""Tensor parallelism: the process group of a model's ranks and its collectives."""
