"""One proposer class per method; vLLM loads them by dotted path (see ``config.METHODS``)."""
