"""Engine-agnostic pieces of prefill-accel's scheduling policies, pure Python, no engine types.
The step planner (:mod:`prefill_accel.engine.planner`), which every engine's scheduler calls
through its adapter, is made of these:

- ``prefills.py``: the max-min fair share of a step's prefill budget (:func:`water_level`), the
  waiting prefills a step takes whole beside a partial one (:func:`whole_beside`), the
  partial-prefill limits (:class:`PartialPrefills`) over :class:`Chunk` views of the engine's
  prefills, and the SRPF key with aging (:func:`aged_remaining`).
- ``step_time.py``: :class:`StepTimeModel`, the online model of a step's wall time (its decodes'
  cost plus what its prefill chunks add, :func:`attention_pairs`), and the step trace.
- ``step_budget.py``: :class:`PrefillTime`, the step's prefill time under ``--max-step-latency-ms``
  spent chunk by chunk, and the budget's periodic log.
"""
