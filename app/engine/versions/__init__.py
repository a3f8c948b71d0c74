"""A worker's versions made to match the desired state: where models come from, the desired state and its
sync between processes, the apply step (load, route, retire), the writers (start-up, the poll, calls, promotions
and rollbacks), the routing table. The top wing: imports the others."""
