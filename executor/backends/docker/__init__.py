"""The docker backend: a container per trajectory, allocate-on-execution (paper 5.2), with
the agent that runs inside each sandbox and the default sandbox image."""
