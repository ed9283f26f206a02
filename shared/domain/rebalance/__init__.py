"""The rebalancer's rules (the third stage: prefilter -> score -> rebalance): sustained-threshold detectors
(``detect``), make-before-break plans for consolidation, replacement and replication (``plans``), and
TPU defragmentation (``tpu_defrag``), and when a draining replica may be released (``drain``). Pure: no IO,
``now`` passed in."""
