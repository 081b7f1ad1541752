"""Ray: the embedded local cluster on loopback, and role services as Ray actors."""
