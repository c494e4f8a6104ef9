"""ddiloco: Decoupled DiLoCo for resilient distributed pre-training.

Independent learners run ordinary inner optimizer steps and stream compressed outer-gradient
fragments over gRPC to a stateful synchronizer, which merges whatever has arrived once a minimum
quorum is met and an adaptive grace window has passed. Sub-packages:

- ``ddiloco.fragments``: partition, schedule, outer gradients, codecs, chunking, wire messages;
- ``ddiloco.synchronizer``: the synchronizer service (quorum, grace, merge, outer step, commit);
- ``ddiloco.learner``: the learner service and the local ``ddiloco run`` orchestration.
"""

__version__ = "0.1.0"
