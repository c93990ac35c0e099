"""Batched token sampling: logit bias, penalties, temperature, top-k/top-p/min-p, logprobs.

One engine step hands the sampler a ``[B, V]`` block of next-token logits, one row per
sequence being sampled, and a :class:`SamplingBatch` holding each row's parameters. The
semantics follow the OpenAI API as vLLM implements it:

1. ``logit_bias`` is added to the raw logits.
2. Penalties: repetition (prompt and output tokens; positive logits are divided by the
   penalty, negative ones multiplied), then frequency (``- freq * count``) and presence
   (``- presence * (count > 0)``), both counted over output tokens only.
3. Greedy rows (temperature < 1e-5) take the argmax of the processed logits; ties go to
   the lowest token id.
4. Random rows divide by their temperature, keep the top-k tokens, then the smallest
   prefix of those whose renormalised mass reaches top-p, then the tokens whose
   probability is at least ``min_p`` times the largest, and sample from what is left.
5. Logprobs (chosen token and top-k alternatives) come from ``log_softmax`` of the RAW
   logits, before bias, penalties, temperature and filters.

Sampling is an exponential race: the winner is ``argmax_i p_i / E_i`` with ``E_i``
i.i.d. Exponential(1), which picks token ``i`` with probability ``p_i``. A row with its
own seeded generator draws its ``E`` from it, a number of values and an order (token id
order) fixed by the row alone, so a seeded request gets the same tokens whatever else is
in the batch and wherever its row sits. Rows without a generator share one draw from
torch's global RNG.

Cost notes (CPU, V ~ 50k): torch's CPU RNG and ``topk``/``sort`` are slow per element,
so the sampler avoids full-vocabulary noise and sorts:

* rows without filters race in two rounds, first between blocks of 256 ids (weighted by
  block mass), then inside the winning block: V/256 + 256 noise values, still exact;
* filtered rows look for their cut-off among their 64 best tokens, then 512, then 4096,
  and only a row whose kept set is larger still pays for a full sort; they race only
  over the tokens they keep;
* argmax and small top-k pre-select blocks of 64 ids by their maxima.

Penalties touch only the ``row * V + token`` positions that occurred, so their cost
follows the number of prompt/output tokens, not ``B * V``.
"""

from tokenyard.engine.sample.metadata import GREEDY_TEMPERATURE_EPS, SamplingBatch, make_generator
from tokenyard.engine.sample.sampler import Sampler, SamplerOutput

__all__ = ["GREEDY_TEMPERATURE_EPS", "Sampler", "SamplerOutput", "SamplingBatch", "make_generator"]
