"""The bounds every reader of untrusted bytes and every producer of values share: one copy, so
that what a task may declare, what the wire carries and what a syncer's state holds agree
(a tensor the codec accepts is one the state can hold and a task may have).
"""

MAX_TENSORS = 100_000  # tensors of a model (and so of any fragment or message)
MAX_NDIM = 8  # dimensions of one tensor
MAX_NAME = 1024  # characters of a tensor name on the wire (a task's are 1..200: pipeline.task)
MAX_LEARNERS = 100_000  # learners of a run (`learners`; entries of a published merge map)
MAX_LEARNER_ID = 1024  # bytes of a learner id in a syncer's state and on the wire
MAX_FRAGMENT = 9999  # a fragment's index: topics and keys are fixed width, four digits
