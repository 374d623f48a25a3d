"""Turning a validated config into running processes: job plan, sbatch text, executors.

Only the entry points (``relax_hpc.submit``) import this package.
"""
