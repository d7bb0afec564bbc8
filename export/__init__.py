"""Torch side: turn a Hugging Face causal LM pair into a validated Mirror-SD bundle."""
