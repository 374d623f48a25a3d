"""Prompt data: the synthetic addition task, file datasets, and the resumable sampler."""
