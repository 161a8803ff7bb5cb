"""How a worker's variables are cut into the messages of a step (:mod:`psframe.worker.plan.step_plan`).

The bottom of the worker side: the client sends what the plan says, and the
replica and its tables fill it.
"""
