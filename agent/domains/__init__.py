"""Compute domains on this node: the IMEX node list a domain gives, this node's IMEX daemon,
and the channel a domain's claims hold."""
