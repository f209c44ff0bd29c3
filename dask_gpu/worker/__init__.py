"""Runs in a GPU worker (trusted: it holds the plane's ticket key and the cluster's certificate): tickets checked, devices held, bodies contained, started and ended; a body's life as steps."""
