"""DReSD's projection of hidden states into keys: z-score, PCA, L2 (arXiv 2502.15572),
fitted by streaming sampled states, so its memory is bounded by the hidden size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.format import DatastoreError

#: Rows of hidden states read at a time by the PCA fit and the key projection: a chunk of
#: float64 rows takes at most this many bytes, whatever the hidden size.
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Projection:
    """z-norm -> PCA -> L2, fitted on a sample of hidden states."""

    mean: np.ndarray  # float32 [H]
    inv_std: np.ndarray  # float32 [H]
    components: np.ndarray  # float32 [H, d]
    explained_variance: float

    def __call__(self, states: Any) -> np.ndarray:
        """Unit rows float32 [B, d] for a [B, H] torch tensor of any float dtype (on any device:
        the fused Triton kernel on GPU, the torch reference on CPU)."""
        return self.on_device(states).cpu().numpy()

    def on_device(self, states: Any) -> Any:
        """The unit rows left on the states' device, for a caller that copies them to the host
        itself (``drafting.streams``)."""
        from vllm_retrieval_spec.kernels.projection import project

        return project(states, *self._parameters(states.device))

    def _parameters(self, device: Any) -> tuple[Any, Any, Any]:
        # Converted once per device: every decoding step projects.
        cache = self.__dict__.setdefault("_device_params", {})
        if device not in cache:
            import torch

            cache[device] = tuple(torch.from_numpy(np.asarray(a)).to(device)
                                  for a in (self.mean, self.inv_std, self.components))
        return cache[device]


def check_pca_dims(dims: int, hidden_size: int) -> None:
    if not 1 <= dims <= hidden_size:
        raise DatastoreError(
            f"PCA dims {dims} is out of range: must be in [1, {hidden_size}] (the hidden size)")


def chunk_rows(hidden_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of float64 hidden states that fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (8 * hidden_size))


def fit_projection(states: Any, dims: int, rows: np.ndarray | None = None, *,
                   chunk_bytes: int = CHUNK_BYTES, progress: bool = False) -> Projection:
    """z-score statistics and the top ``dims`` principal directions of ``states[rows]`` (every
    row by default); ``states`` is [N, H]: an array, a memory map or a CPU tensor.

    Streamed, so that memory does not grow with the sample: chunks of rows (``chunk_bytes`` as
    float64) are read in turn while their sum and Gram matrix accumulate in float64 (H^2 x 8
    bytes plus 1.5 chunks: the float32 rows read and their float64 copy). The peak is at the
    eigendecomposition: the H x H covariance, its eigenvectors and LAPACK's workspace (syevd:
    2 x H x H), 4 x H^2 x 8 bytes (512 MiB for H = 4096; measured in
    benchmarks/results/pca-fit-memory.md). The covariance of z-scored states is only H x H, so
    an exact symmetric eigendecomposition (torch.linalg.eigh) is cheaper than an iterative
    low-rank PCA and gives the explained variance for free.
    """
    import torch
    from tqdm import tqdm

    states = np.asarray(states)  # a view: of a CPU tensor, or of a memory map (still mapped)
    hidden_size = states.shape[1]
    n = states.shape[0] if rows is None else len(rows)
    check_pca_dims(dims, hidden_size)
    if n < 2:
        raise DatastoreError(f"need at least 2 hidden states to fit the projection, got {n}")
    step = chunk_rows(hidden_size, chunk_bytes)
    total = torch.zeros(hidden_size, dtype=torch.float64)
    gram = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
    shift = None
    for start in tqdm(range(0, n, step), desc="fitting the projection", unit="chunk",
                      disable=not progress):
        index = slice(start, start + step) if rows is None else rows[start:start + step]
        # np.array copies: a slice of a read-only memory map is never written to.
        chunk = torch.from_numpy(np.array(states[index], dtype=np.float64))
        if shift is None:
            # Sums around a point near the mean rather than around 0: the covariance is then a
            # difference of numbers of the spread's size, not of the states' magnitude.
            shift = chunk.mean(0)
        chunk -= shift
        total += chunk.sum(0)
        gram.addmm_(chunk.T, chunk)
        del chunk  # before the next one is read: one chunk at a time
    offset = total / n  # mean - shift
    mean = shift + offset
    # In place (no second H x H matrix): sum (x - mean)(x - mean)^T = gram - n offset offset^T.
    covariance = gram.addr_(offset, offset, alpha=-n).div_(n - 1)
    # Constant dimensions carry nothing; a floor on the std keeps them from blowing up.
    std = covariance.diagonal().clamp_min(0).sqrt().clamp_min(1e-6)
    # The covariance of the z-scored states (x - mean) / std, in place.
    covariance.div_(std[:, None]).div_(std[None, :])
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    top = torch.argsort(eigenvalues, descending=True)[:dims]
    explained = float(eigenvalues[top].clamp_min(0).sum() / eigenvalues.clamp_min(0).sum())
    return Projection(
        mean=mean.float().numpy(),
        inv_std=(1.0 / std).float().numpy(),
        components=eigenvectors[:, top].float().contiguous().numpy(),
        explained_variance=explained,
    )


