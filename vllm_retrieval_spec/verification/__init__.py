"""Token-tree verification inside vLLM: one core, one module per attention backend."""
