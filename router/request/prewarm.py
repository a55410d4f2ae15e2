"""Cache.Prewarm as a request: a prompt computed on the worker routing chooses (prefix and
affinity routing, as Generate's), answered with one greedy token that is thrown away, never
from nor into the response cache, under the retention and session asked.
"""

from __future__ import annotations

from router.domain import GenerateInput, PrewarmInput, PrewarmResult
from workers.protocol import Usage
from workers.sampling_params import SamplingParams

_ONE_GREEDY_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def prewarm_request(inp: PrewarmInput) -> GenerateInput:
    """The generate request that warms `inp`'s prompt."""
    return GenerateInput(
        request_id=inp.request_id,
        prompt=inp.prompt,
        params=_ONE_GREEDY_TOKEN,
        cache_salt=inp.cache_salt,
        use_response_cache=False,  # a stored answer would skip the worker: nothing warmed
        retention_s=inp.retention_s,
        affinity_key=inp.affinity_key,
        session_id=inp.session_id,
        tenant=inp.tenant,
    )


def prewarm_result(usage: Usage) -> PrewarmResult:
    """The prewarm's answer from its request's usage: the prompt's full-block tokens its worker
    holds now are those it read from the cache plus those it wrote to it."""
    return PrewarmResult(
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cache_read_tokens + usage.cache_write_tokens,
        worker_id=usage.worker_id,
        retained_tokens=usage.retained_tokens,
        retention_trimmed_tokens=usage.retention_trimmed_tokens,
    )
