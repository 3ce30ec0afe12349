"""Where a trial's time between two reports goes besides training steps; each report row holds these
(`search.lineage`), `raytrain tune report` sums them (`search.report`):

- slot_s: waiting for a Train-run slot (a population larger than the cluster takes turns: search.slots)
- start_s: starting a Train run (Ray Train's workers, the model, restoring its checkpoint)
- decision_s: waiting for the scheduler's decision (Tune's round trip; synchronous PBT's barrier)
- exploit_s: loading an exploit's checkpoint into the live run
- eval_s: evaluating the validation loss
- checkpoint_s: the time a checkpoint held training (staging, with asynchronous checkpoints)

The rest of the interval is reporting (Tune's and Ray Train's bookkeeping, the pins).
"""

TIME_PARTS = ("slot_s", "start_s", "decision_s", "exploit_s", "eval_s", "checkpoint_s")
