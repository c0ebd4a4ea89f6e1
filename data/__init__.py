"""Data: text to token shards, and shards to per-rank batches.

- ``data.tokenizer``: ``ByteTokenizer`` (no files) and ``HFTokenizer`` (a local tokenizer.json).
- ``data.prepare``: ``python -m data.prepare`` writes ``train-*.bin``, ``val-*.bin``, index.json.
- ``data.loader``: ``DataConfig``, ``open_sources`` and ``build_dataloader`` for the trainer.
- ``data.stream``: the global stream as index arithmetic: mixtures, epochs, the batch sampler.
- ``data.shuffle``: a seeded permutation of [0, n) computed per index (each epoch's order).

Nothing is re-exported here, so ``python -m data.prepare`` does not pay for importing torch.
"""
