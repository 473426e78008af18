"""The served store on disk: saved as a datastore directory (atomically) every few minutes
and at shutdown, and loaded from it at start-up (``datastore.served``)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.dense import DENSE_DIR
from vllm_retrieval_spec.datastore.format import MANIFEST_FILE
from vllm_retrieval_spec.datastore.served import ServedStore
from vllm_retrieval_spec.datastore.served_dense import ModelFacts, ServedDenseStore

logger = logging.getLogger(__name__)


def write_served_dense_keys(snapshot: tuple[np.ndarray, np.ndarray], projection: Any,
                      model: ModelFacts, directory: Path, manifest: Any) -> None:
    """The served dense keys as ``directory``'s dense index (``build``'s ``then`` hook)."""
    from vllm_retrieval_spec.datastore.dense import write_dense_keys
    from vllm_retrieval_spec.datastore.format import TOKENS_FILE

    keys, positions = snapshot
    if not len(keys):
        return

    def fill(out: np.ndarray) -> None:
        out[:] = keys.astype(np.float16)

    write_dense_keys(directory / DENSE_DIR, manifest.files[TOKENS_FILE]["sha256"], len(keys),
                     fill, positions, projection, model_name=model.name,
                     model_fingerprint=model.fingerprint, hidden_size=model.hidden_size,
                     layer=model.layer, dtype=model.dtype, num_fit_samples=0, scann=False,
                     progress=False)


class PeriodicSaver:
    """Saves a served store to a datastore directory every ``interval_s`` seconds while it
    changes, and once more when the process exits; loads that directory first if it exists.

    Each save is a complete datastore written under a temporary name and renamed into place
    (``atomic_path``), so a crash mid-save leaves the previous save, which loads.
    """

    def __init__(self, store: ServedStore, path: str | Path, model_config: Any,
                 interval_s: float, dense: ServedDenseStore | None = None) -> None:
        self.store = store
        self.dense = dense
        self.path = Path(path)
        self.interval_s = interval_s
        self._saved_version: tuple[int, int] = (-1, -1)
        # At start-up, not at the first save: the last save happens while vLLM shuts the worker
        # down, and a worker that takes long to exit is killed.
        self._tokenizer = self._tokenizer_facts(model_config)
        self._model = ModelFacts.of(model_config) if dense is not None else None
        if (self.path / MANIFEST_FILE).is_file():
            # The front-end checked its tokenizer fingerprint against the model's (and its
            # dense index against the model, ``config.model.validate_against_model``).
            documents = store.load(self.path)
            # Indexed before the first request is drafted (start-up, not a decoding step).
            store.wait_indexed()
            logger.info("served store: loaded %d tokens from %s", sum(map(len, documents)),
                        self.path)
            if dense is not None and (self.path / DENSE_DIR / MANIFEST_FILE).is_file():
                self._load_dense(documents)
        self._saved_version = self._version()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._save_periodically, name="served-store-save",
                                        daemon=True)
        self._thread.start()

    def save_if_changed(self) -> bool:
        version = self._version()
        if version == self._saved_version:
            return False
        name, fingerprint, vocab_size = self._tokenizer
        self.store.save(self.path, tokenizer_name=name, tokenizer_fingerprint=fingerprint,
                        vocab_size=vocab_size, dense=self.dense, model=self._model)
        self._saved_version = version
        return True

    def _version(self) -> tuple[int, int]:
        # The dense keys of a finished request are indexed after its tokens are stored.
        return self.store.version, 0 if self.dense is None else self.dense.inserted

    def _load_dense(self, documents: list[np.ndarray]) -> None:
        from vllm_retrieval_spec.datastore.dense import DenseIndex

        index = DenseIndex.from_path(self.path, search="exact", verify_checksums=False)
        loaded = self.dense.load_keys(documents, np.asarray(index.keys), index.positions,
                                      index.projection)
        self.dense.wait_indexed()
        logger.info("served dense store: loaded %d keys from %s", loaded, self.path)

    def close(self) -> None:
        """Stop saving periodically; save what changed since the last save."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=60)
        self._save_logged()

    def _save_periodically(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._save_logged()

    def _save_logged(self) -> None:
        try:
            if self.save_if_changed():
                logger.info("served store: saved %d tokens to %s", self.store.num_tokens,
                            self.path)
        except Exception:
            # Serving goes on; the previous save stays in place.
            logger.exception("could not save the served store to %s", self.path)

    @staticmethod
    def _tokenizer_facts(model_config: Any) -> tuple[str, str, int]:
        """(name, fingerprint, vocab size) of the served model's tokenizer, for the manifest."""
        from transformers import AutoTokenizer

        from vllm_retrieval_spec.datastore.format import tokenizer_fingerprint, tokenizer_vocab_size

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code)
        return (Path(str(model_config.tokenizer)).name, tokenizer_fingerprint(tokenizer),
                tokenizer_vocab_size(tokenizer))
