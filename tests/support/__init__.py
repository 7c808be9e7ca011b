"""Helpers the tests share: the scripted fake upstream (FU), in-process and child-process gateways,
raw HTTP on sockets, and checks on what the gateway answers."""
