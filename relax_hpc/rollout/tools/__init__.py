"""Tool calls: parsing them out of generated text, and running them in sandboxed processes.

``parser`` reads the chat template's tool-call format (Qwen3's ``<tool_call>`` JSON);
``sandbox`` runs tool functions in worker processes with a timeout and an output cap;
``python_exec`` runs untrusted Python in a fresh, resource-limited interpreter.

Must not: import torch, the engines or the trainer (tool workers import this package).
"""
