"""Runs inside a body (untrusted: a tenant's code runs here): the child loop, shipped code, its devices and gang; it imports nothing that holds a key or a ticket registry."""
