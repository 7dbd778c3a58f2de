"""Checkpoint format: atomic, checksummed, partition-independent safetensors shards.

* :mod:`.format` describes the files; :mod:`.store` reads, lists, verifies and prunes them;
* :mod:`.writer` encodes shards and commits a step atomically; :mod:`.rng` is the RNG state;
* :mod:`.rootdir` names, finds and deletes a root's directories (fsync, SHA-256 of a file);
* :mod:`.restore` is the pure policy choosing which checkpoint copy a recovery restores.

Import from the modules: this package re-exports nothing, so the restore policy and a
site's checkpoint store (:mod:`geopipe.runtime.storage.sitestore`), which lists, verifies,
commits and serves copies as files, import without torch: a store imports in 0.07 s
instead of 1.1 s, beside the stage actors starting on the same cores. (It loads
torch later, at its first same-site pull: Ray loads a stage actor's class with its handle.)
"""
