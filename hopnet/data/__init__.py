"""Data for the members of an elastic run: :class:`ElasticSampler` (docs/guides/data.md).

Imports torch, and nothing of hopnet's runtime or protocols: the runtime tells a sampler of a
view change, the sampler knows nothing of how views are agreed.
"""

from hopnet.data.epochs import FixedEpochs, batches_per_epoch
from hopnet.data.sampler import ElasticSampler
from hopnet.data.split import Split

__all__ = ["ElasticSampler", "FixedEpochs", "Split", "batches_per_epoch"]
