"""The dilated (LongNet) attention op: one device, decoding, packed documents and its ring.

- :mod:`dilax.dilated.api`: :func:`dilated_attention`, the op (``sequence_parallel=`` runs it
  as a ring over a mesh).
- :mod:`dilax.dilated.settings`: :class:`DilatedSettings`, the static configuration.
- :mod:`dilax.dilated.documents`: packed documents (``segment_ids``), a branch per document view.
- :mod:`dilax.dilated.decode`: :class:`KVCache` and :func:`dilated_attention_decode`.
- :mod:`dilax.dilated.ring`: :func:`ring_dilated_attention`, the per-device op for a user's own
  ``shard_map``; :mod:`dilax.dilated.ring_branches`, :mod:`dilax.dilated.ring_dilate` and
  :mod:`dilax.dilated.ring_documents` are its branch kinds, its dilated layout and its
  documents (on the shared ring machinery of :mod:`dilax.sp`).
"""
