"""The host daemon, ondemand-profd: registry of live ranks, aligned capture windows, capture records."""
