"""Retrieval-based speculative decoding (REST, PLD+, DReSD) as a vLLM plugin."""
