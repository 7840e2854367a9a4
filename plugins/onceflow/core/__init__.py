"""The transaction protocol: declaration and registry, the transaction log, begin, staging,
commit, offsets, backflow, state tables and the opaque rule."""
