"""Curation: production failures become redacted, deduplicated, verifiable RL tasks.

One module per step, in the order a trace meets them:

- ``selection``  which traces are curated (failures, a stable sample of successes) and which
                 bodies are refused before an adapter sees them;
- ``adapters``   the environment's trace adapter: trace → task with a verifier, or a reason;
- ``redaction``  sensitive values replaced and counted before anything is stored;
- ``similarity`` content hashes, MinHash signatures, LSH bands;
- ``dedup``      near-duplicate and cluster decisions (pure, order-independent);
- ``splits``     train/eval/held-out by cluster, regression for successes and pinned tasks;
- ``pipeline``   one batch in one transaction: the steps above plus the writes;
- ``results``    what curation hands back: a batch's counts, a snapshot's dataset;
- ``difficulty`` the probe-based filter (pure);
- ``probe``      the probe run's task file and its results as pass rates of tasks;
- ``snapshot``   immutable, content-addressed datasets and their JSONL files;
- ``drift``      the served model's rolling failure rate, a trigger for the loop;
- ``policy``     the ``loops.curation_policy`` keys and their defaults;
- ``cli``        ``ratchet tasks`` and ``ratchet datasets``.

docs/curation.md explains the whole path and every policy key.
"""
