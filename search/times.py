"""Where a trial's time between two reports goes besides training steps: each report row holds these parts
(`search.lineage`), `raytrain tune report` sums them (`search.report`). The rest of the interval is
reporting (Tune's and Ray Train's bookkeeping, the pins)."""

# each part -> what the report calls it
TIME_PARTS: dict[str, str] = {
    "slot_s": "waiting for a slot (time-sharing)",  # a population larger than the cluster takes turns
    "start_s": "starting Train runs",  # Ray Train's workers, the model, restoring its checkpoint
    "decision_s": "waiting for the scheduler's decisions",  # Tune's round trip; synchronous PBT's barrier
    "exploit_s": "loading exploits",  # an exploit's checkpoint into the live run
    "eval_s": "evaluation",  # the validation loss
    "checkpoint_s": "checkpoints holding training",  # staging, with asynchronous checkpoints
}
