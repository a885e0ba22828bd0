"""API quotas and other counted resources (paper 5.1), and the backoff after a 429."""
