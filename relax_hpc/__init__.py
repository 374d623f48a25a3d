"""relax_hpc: reinforcement-learning post-training of language models, native to Slurm.

The package is split by responsibility; see README.md for the map. Importing the
package itself pulls in nothing heavy (no torch, no Hydra).
"""

__version__ = "0.1.0"
