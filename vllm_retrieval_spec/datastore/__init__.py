"""Token datastores: the on-disk format, corpus reading, and REST's suffix-array index."""

from vllm_retrieval_spec.datastore.build import build_datastore, build_datastore_from_token_ids
from vllm_retrieval_spec.datastore.format import (
    FORMAT_VERSION,
    SEPARATOR,
    Datastore,
    DatastoreError,
    Manifest,
    load_datastore,
    tokenizer_fingerprint,
)
from vllm_retrieval_spec.datastore.suffix_array import (
    SuffixArrayDatastore,
    build_suffix_array,
    gather_continuations,
    longest_suffix_match,
)

__all__ = [
    "FORMAT_VERSION",
    "SEPARATOR",
    "Datastore",
    "DatastoreError",
    "Manifest",
    "SuffixArrayDatastore",
    "build_datastore",
    "build_datastore_from_token_ids",
    "build_suffix_array",
    "gather_continuations",
    "load_datastore",
    "longest_suffix_match",
    "tokenizer_fingerprint",
]
