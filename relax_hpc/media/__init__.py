"""Media (images, audio) from dataset rows to model inputs; see ``docs/multimodal.md``."""
