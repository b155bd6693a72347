"""Scale-out on Ray: the batched offline job over a cluster (:mod:`.ray_batch`).

Ray is an optional dependency (``pip install 'speculative[ray]'``); nothing here imports it
until a job asks for it, so a plain install works without it.
"""
