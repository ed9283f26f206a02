"""The rebalancer's rules (the third stage: prefilter -> score -> rebalance): sustained-threshold detectors
(``detect``), make-before-break plans for consolidation, replacement and replication (``plans``), and
TPU defragmentation (``tpu_defrag``). Pure: no IO, ``now`` passed in."""
