"""Checkpoint and resume: exact, atomic, elastic.

``Checkpointer(directory, keep=3).save(step, model=..., optimizer=..., ...)`` writes one
folder per checkpoint; ``load_latest(**same_names)`` restores the newest one that verifies.
``saved_state(info.manifest, name)`` reads one object's saved state without loading
anything (e.g. the settings a run is rebuilt from); ``written_by_gradstep(folder)`` tells
gradstep's checkpoint folders from anyone else's. ``with read_lease(step_folder): ...`` pins
a checkpoint while another process reads it: a save's pruning skips a leased folder (the
protocol is in :mod:`.layout`).

Layout of ``directory`` (one writer at a time)::

    step-000120/                     one published checkpoint (never modified afterwards)
        manifest.json                written last: metadata, non-tensor state, checksums
        model.safetensors            single process: the module's state_dict (FQN keys)
        optimizer.safetensors        single process: optimizer tensors, keyed by param FQN
        objects.safetensors          tensors found in the other objects' state (if any)
        dcp/                         several ranks: model + optimizer via
                                     torch.distributed.checkpoint (one file per rank)
        rng-rank00000.json           python / numpy / torch (CPU, CUDA) RNG of each rank
    .tmp-step-000130/                a save in progress (ignored, removed by the next save)

``manifest.json`` holds: format and version, step, world size, accumulation steps,
micro-batch size, global batch, gradstep and torch versions, the size and sha256 of every
other file, each object's non-tensor state as JSON (tensors are ``{"__gradstep__":
"tensor", "key": K}`` references into the object's safetensors file; tuples, non-finite
floats and dicts with non-string keys are tagged the same way, so the JSON is strict and
round-trips exactly) and its own sha256 (``checksum``, over the canonical JSON of the rest).

Why each rule exists:

* Atomic: files go to ``.tmp-step-N``, are fsynced, then the manifest, then the folder is
  fsynced and renamed to ``step-N`` (a single atomic rename) and the parent fsynced; only
  then are old checkpoints pruned (renamed away first, so a half-deleted folder is never
  visible). A process killed at any instant leaves every published checkpoint intact.
* Verified: loading hashes every file against the manifest; a truncated or corrupted
  checkpoint is reported in one warning line and the next older one is used.
* Validated before modified: every tensor is read and the model/optimizer structure is
  checked (missing, unexpected and mis-shaped keys, all listed) before anything is loaded;
  other objects are rolled back if a later one refuses its state.
* Elastic: several ranks save model and optimizer through DCP (any sharding, resharded on
  load); other objects' state is taken from rank 0 (in gradstep it is identical on every
  rank, and the data position is global). :func:`elastic_accum_steps` keeps the global
  batch when the number of data-parallel ranks changes (the manifest's ``dp_size``: the
  world size, except under FSDP2 + tensor parallel, whose peers read the same data; a
  (dp=2, tp=2) checkpoint resumes on 2 plain FSDP2 ranks with the same ``accum_steps``).
* The optimizer is stored with parameter names, not indices, so a checkpoint survives
  re-wrapping (DDP, FSDP2, ``torch.compile``). Locally the name mapping is done in
  :mod:`.state` rather than with ``get_optimizer_state_dict``: that function initialises an
  empty optimizer by running a zero-lr ``step()``, which would turn a fresh AdamW into one
  at step 1 and break an exact resume from a step-0 checkpoint.
* Adapters stay on their base: a ``trainable_only`` checkpoint records a fingerprint of the
  frozen weights it was trained on (``objects.<model>.base_fingerprint``) and refuses to load
  onto another base; one saved before fingerprints loads with a warning.

Modules: :mod:`.checkpointer` (the :class:`Checkpointer`: save and load orchestration),
:mod:`.info` (:class:`CheckpointInfo`), :mod:`.objects` (which keyword object is the model,
which the optimizer), :mod:`.restore` (the load path: validate everything, then load),
:mod:`.layout` (the atomic-file API: the folder protocol, the manifest and read leases),
:mod:`.lease` (the locks of a lease), :mod:`.codec` (strict JSON and safetensors files),
:mod:`.state` (model and optimizer, file and DCP paths), :mod:`.safe_dcp` (DCP's pickles
read as data only), :mod:`.rng` (RNG state), :mod:`.elastic` (the global batch on another
number of ranks), :mod:`.fingerprint` (the frozen base an adapter-only checkpoint was
trained on), :mod:`.errors` (:class:`CheckpointError`).
"""

from __future__ import annotations

from .checkpointer import Checkpointer
from .codec import saved_state
from .elastic import elastic_accum_steps
from .errors import CheckpointError
from .fingerprint import Fingerprint, base_fingerprint
from .info import CheckpointInfo
from .layout import FORMAT as FORMAT
from .layout import FORMAT_VERSION as FORMAT_VERSION
from .layout import MANIFEST as MANIFEST
from .layout import read_lease, written_by_gradstep

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "Fingerprint",
    "base_fingerprint",
    "elastic_accum_steps",
    "read_lease",
    "saved_state",
    "written_by_gradstep",
]
