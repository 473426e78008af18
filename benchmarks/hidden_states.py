"""Hidden states of recorded outputs from a transformers forward, for the lab tools that replay
them (``replay``, ``dense_search``): what vLLM's runner would hand a drafter at each position."""

from __future__ import annotations

from typing import Any

import numpy as np


class TransformersStates:
    """Hidden states (float32 [tokens, H]) of a record's prompt and output from one
    transformers forward: layer ``l``'s residual stream (0: the embeddings), as vLLM's
    auxiliary states count layers, or the final normed states (``layer=None``)."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.hidden_size = self.model.config.hidden_size
        self.vocab_size = self.model.config.vocab_size
        self.cache: dict[tuple[tuple[int, ...], int], np.ndarray] = {}

    def __call__(self, record: dict[str, Any], layer: int | None = None) -> np.ndarray:
        sequence = tuple(record["prompt"] + record["output"])
        layer = self.model.config.num_hidden_layers if layer is None else layer
        if (sequence, layer) not in self.cache:
            with self.torch.no_grad():
                out = self.model(self.torch.tensor([sequence]), output_hidden_states=True)
            self.cache[sequence, layer] = out.hidden_states[layer][0].numpy()
        return self.cache[sequence, layer]
