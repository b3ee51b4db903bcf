"""Drop the samples a quarantined box made unvouched before the trainer computes their advantages.

A box's tokens are provisional until a trust probe sent after them passes. When a box is quarantined, its
running sequences are cut back (their answers never carry those tokens), but answers delivered before that
may; the manager lists them (``GET /distrusted_samples?after=N``: the answer's id and the segment's box,
version and token range, numbered). Before verl computes a micro-batch's advantages the plugin reads what is
new, and every sample of the batch with such a segment, or with a segment the manager flagged ``distrusted``
in its ``meta_info`` (an answer that finished on the box before its cut-back landed), leaves the batch as
verl's own padding samples do (``verl.trainer.ppo.padding_utils``): its ``response_mask`` (and ``loss_mask``)
zeroed, so none of its tokens reach the loss, and a ``uid`` of its own, so it is no GRPO sibling of anyone:
the advantages of its prompt's other samples are computed over them alone (a group-relative baseline never
includes a dropped sample). Zeroing the masks after the advantages (what the plugin did before) left the
dropped sample's reward in its siblings' baseline.

:class:`DistrustFilter` keeps the records seen (bounded) and the reader's cursor; :func:`distrusted_rows` is
the pure match (lists in, booleans out), tested without verl; :func:`drop_fields` what to write back. A
manager that cannot be reached costs a warning and the step goes on unprotected (said in the step's metrics
as ``distrust_check_failed``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .metrics import call_sync
from .mismatch import per_sample

log = logging.getLogger("trainer_plugin.distrust")

KEEP_KEYS = 500_000  # distrusted segments remembered across steps (a sample may be trained on steps later)
MASK_FIELDS = ("response_mask", "loss_mask")
READ_FIELDS = ("extra_fields", "uid", *MASK_FIELDS)  # what drop_fields reads of a batch
DROPPED_UID = "rollout-manager-distrusted:"  # + the sample's TransferQueue key: a group of its own


@dataclass(frozen=True, slots=True)
class SegmentKey:
    """One segment of one answer, as the manager lists it and as the sample's ``extra_fields`` keep it."""

    request_id: str
    instance: str
    start: int
    end: int


def key_of(request_id: Any, seg: Mapping[str, Any]) -> SegmentKey:
    return SegmentKey(str(request_id), str(seg.get("instance")), int(seg.get("start", 0)), int(seg.get("end", 0)))


def distrusted_rows(extras: Sequence[Mapping[str, Any] | None], keys: set[SegmentKey] | Mapping[SegmentKey, Any]
                    ) -> list[bool]:
    """Per sample (its ``extra_fields``: ``request_id``, ``segments``): whether it has a segment the manager
    listed as distrusted or flagged ``distrusted`` in its own outcome."""
    out = []
    for extra in extras:
        segs = extra.get("segments") if isinstance(extra, Mapping) else None
        rid = extra.get("request_id") if isinstance(extra, Mapping) else None
        bad = False
        for seg in segs or ():
            if "distrusted" in str(seg.get("outcome") or "") or (rid is not None and key_of(rid, seg) in keys):
                bad = True
                break
        out.append(bad)
    return out


@dataclass
class DistrustFilter:
    """The distrusted segments read from the manager so far, and where to read on from."""

    manager_url: str
    after: int = 0
    keys: OrderedDict[SegmentKey, None] = field(default_factory=OrderedDict)
    missed: int = 0  # samples the manager no longer kept when read (a reader too far behind)

    def refresh(self) -> None:
        """Read what the manager listed since the last call."""
        page = call_sync(self.manager_url, lambda client: client.distrusted_samples(self.after))
        for sample in page.get("samples", []):
            self.keys[key_of(sample["request_id"], sample)] = None
        while len(self.keys) > KEEP_KEYS:
            self.keys.popitem(last=False)
        self.missed += int(page.get("missed", 0))
        self.after = max(self.after, int(page.get("last", self.after)))

    def rows(self, extras: Sequence[Mapping[str, Any] | None]) -> list[bool]:
        return distrusted_rows(extras, self.keys)


def zero_rows(values: Any, rows: Sequence[bool]) -> Any:
    """``values`` (one row per sample: a jagged nested tensor, a padded tensor or a list of rows) with the
    rows marked True set to zero, the rest unchanged."""
    if getattr(values, "is_nested", False):
        import torch

        parts = [t * 0 if drop else t for t, drop in zip(values.unbind(), rows, strict=True)]
        return torch.nested.as_nested_tensor(parts, layout=values.layout)
    if hasattr(values, "clone"):
        out = values.clone()
        for i, drop in enumerate(rows):
            if drop:
                out[i] = 0
        return out
    return [[0 for _ in row] if drop else row for row, drop in zip(values, rows, strict=True)]


def drop_fields(data: Any, keys: Sequence[str], flt: DistrustFilter, done: set[str] | None = None
                ) -> tuple[dict[str, Any], list[str]]:
    """What to write back for the samples of ``data`` (a batch as ``tq.kv_batch_get`` gives it for ``keys``,
    with :data:`READ_FIELDS`) that are distrusted and not in ``done`` (dropped already): the mask fields with
    their rows zeroed and the ``uid`` column with theirs made their own; and the keys of those samples (none:
    nothing to write)."""
    rows = flt.rows(per_sample(data["extra_fields"]))
    if done:
        rows = [drop and key not in done for drop, key in zip(rows, keys, strict=True)]
    dropped = [key for key, drop in zip(keys, rows, strict=True) if drop]
    if not dropped:
        return {}, []
    fields = {n: zero_rows(data[n], rows) for n in MASK_FIELDS if _has(data, n)}
    fields["uid"] = [f"{DROPPED_UID}{key}" if drop else uid
                     for uid, key, drop in zip(list(data["uid"]), keys, rows, strict=True)]
    return fields, dropped


def _has(data: Any, name: str) -> bool:
    try:
        return name in data.keys()
    except AttributeError:
        return name in data
