"""What model is this: the hashes that name a model's learned weights and its drawn features.

Files that outlive a run name the model they came from: a contact regression records the weights
it was fitted on (a regression read by another model is refused or warned about), an
embeddings file and a ProteinGym run record both hashes (a resumed run must use the same
weights and the same FAVOR+ features, or its rows would mix two models). The hashes are
computed here, beside the loaded record (:mod:`protein_performer.interop.record`), so writers
above (``jobs/``, ``contacts/``) ask one place and nothing below has to.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from protein_performer.model.contact_head import attention_layout
from protein_performer.model.cores import drawn_keys

if TYPE_CHECKING:
    from protein_performer.interop.record import LoadedModel


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of a model's learned weights (names, dtypes, shapes, bytes: every tensor but
    what its cores declare drawn, the FAVOR+ random features, and the tied LM-head alias), so a
    regression names the model it was fitted on, two models differing in any learned tensor
    (a position memory's gate included) differ, and an exact and a FAVOR+ conversion of the
    same weights share it."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    drawn = drawn_keys(model)
    for name, tensor in sorted(model.state_dict().items()):
        if name in drawn or (tensor.numel() and tensor.data_ptr() in seen):
            continue
        seen.add(tensor.data_ptr())
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def features_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the tensors the cores draw (FAVOR+ random features; empty for exact
    attention): embeddings depend on them, so a resumed run must use the same ones."""
    digest = hashlib.sha256()
    drawn = drawn_keys(model)
    for name, t in sorted(model.state_dict().items()):
        if name in drawn:
            digest.update(name.encode())
            digest.update(t.detach().to("cpu").float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_hashes(model: torch.nn.Module) -> dict[str, str]:
    """``model_sha256`` and ``features_sha256``: what an embeddings file and a ProteinGym run
    record of the model, so a resume can refuse another one."""
    return {"model_sha256": weights_sha256(model), "features_sha256": features_sha256(model)}


def model_identity(loaded: LoadedModel) -> dict[str, Any]:
    """``layout`` and ``model_sha256`` of a loaded model, as a contact regression records
    them (``ContactRegression(..., **model_identity(loaded))``)."""
    layout = attention_layout(loaded.config)
    return {"layout": layout, "model_sha256": weights_sha256(loaded.model)}
