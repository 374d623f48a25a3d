"""Model building blocks: the offline character tokenizer, model construction, the warm start."""
