"""The study: its storage (``storage``), its creation and the sampler and pruner (``setup``, ``distinct``,
``pruning``), which trials count (``view``), what the measurements of parts say (``measured``), and trials whose
search is gone (``liveness``)."""
