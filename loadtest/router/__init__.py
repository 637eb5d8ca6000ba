"""The router: the goodput policy against least work on real servers, placement at scale, scheduling."""
