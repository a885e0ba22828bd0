"""The Ray backend: one core for a whole Ray cluster, a node agent per node, the direct
channel to each agent and the guard that cleans up after a dead one."""
