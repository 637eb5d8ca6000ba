"""Faults: kills, cancels, malformed requests and floods beside steady traffic."""
