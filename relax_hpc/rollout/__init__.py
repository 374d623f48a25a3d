"""Rollout: generation engines, rewards and the rollout loop (never imports the trainer)."""
